// MLX's CPU quantized matmul, sent to qgemm.c.
//
// MLX computes `quantized_matmul` on its CPU backend one element at a time, in
// the activations' dtype. This is the one place tierlm reaches into it: MLX
// calls a primitive's `eval_cpu` through the primitive's vtable, and
// `tierlm_qmm_hook_install` writes its own function into QuantizedMatmul's slot.
// The function takes the products qgemm.c computes (affine, transposed, 4/5/8
// bits, float32 activations, float32 or float16 scales and biases,
// row-contiguous, a 2-D weight)
// and enqueues them on the stream's CPU encoder as MLX's own eval_cpu does;
// anything else goes to the function that was in the slot. The slot is found
// by building one QuantizedMatmul through MLX's public API and reading the
// offset of UnaryPrimitive::eval_cpu from a pointer to member (Itanium C++ ABI);
// the loader's self-check then proves a product reaches qgemm.c and gives
// MLX's answer, so an MLX that changes any of this is caught at load, not
// computed wrong.
//
// Built against the headers and library of the installed mlx package (native.py).
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

using namespace mlx::core;

namespace {

using Kernel = void (*)(const float *x, long M, long K, const void *w, const float *scales, const float *biases,
                        long N, int bits, int group, float *out);
using HalfKernel = void (*)(const float *x, long M, long K, const void *w, const uint16_t *scales,
                            const uint16_t *biases, long N, int bits, int group, float *out);
using Supports = int (*)(int bits, int group, long K);
using EvalCpu = void (*)(UnaryPrimitive *self, const std::vector<array> &inputs, array &out);

Kernel kernel = nullptr;
HalfKernel half_kernel = nullptr;
Supports supports = nullptr;
EvalCpu original = nullptr;
void **slot = nullptr;
std::atomic<unsigned long> taken{0}, passed{0};

bool ours(const QuantizedMatmul &primitive, const std::vector<array> &inputs, const array &out) {
  auto [group, bits, mode, transpose] = primitive.state();
  if (mode != QuantizationMode::Affine || !transpose || inputs.size() != 4) return false;
  const array &x = inputs[0], &w = inputs[1], &scales = inputs[2], &biases = inputs[3];
  for (const array *a : {&x, &out})
    if (a->dtype() != float32) return false;
  if (scales.dtype() != biases.dtype() || (scales.dtype() != float32 && scales.dtype() != float16)) return false;
  for (const array *a : {&w, &scales, &biases})  // x is copied where it is not (eval_cpu)
    if (!a->flags().row_contiguous) return false;
  long K = x.shape(-1), N = out.shape(-1);
  return w.ndim() == 2 && w.dtype() == uint32 && w.shape(0) == N && scales.ndim() == 2 && K > 0 &&
         x.size() / K * N == out.size() && supports(bits, group, K);
}

// The float32 activations `x` row after row in `into` (x is a strided view).
const float *row_major(const array &x, std::vector<float> &into) {
  into.resize(x.size());
  const float *from = x.data<float>();
  int ndim = static_cast<int>(x.ndim());
  std::vector<int64_t> index(ndim, 0);
  for (size_t i = 0; i < x.size(); i++) {
    int64_t at = 0;
    for (int axis = 0; axis < ndim; axis++) at += index[axis] * x.strides()[axis];
    into[i] = from[at];
    for (int axis = ndim - 1; axis >= 0 && ++index[axis] == x.shape(axis); axis--) index[axis] = 0;
  }
  return into.data();
}

void eval_cpu(UnaryPrimitive *self, const std::vector<array> &inputs, array &out) {
  auto &primitive = *static_cast<QuantizedMatmul *>(self);
  if (!kernel || !ours(primitive, inputs, out)) {
    passed.fetch_add(1, std::memory_order_relaxed);
    original(self, inputs, out);
    return;
  }
  auto [group, bits, mode, transpose] = primitive.state();
  const array &x = inputs[0], &w = inputs[1], &scales = inputs[2], &biases = inputs[3];
  out.set_data(allocator::malloc(out.nbytes()));
  auto &encoder = cpu::get_command_encoder(primitive.stream());
  for (const array *a : {&x, &w, &scales, &biases}) encoder.set_input_array(*a);
  encoder.set_output_array(out);
  long K = x.shape(-1), M = x.size() / K, N = out.shape(-1);
  encoder.dispatch([out = array::unsafe_weak_copy(out), x = array::unsafe_weak_copy(x),
                    w = array::unsafe_weak_copy(w), scales = array::unsafe_weak_copy(scales),
                    biases = array::unsafe_weak_copy(biases), M, K, N, bits = bits, group = group]() mutable {
    std::vector<float> gathered;
    const float *rows = x.flags().row_contiguous ? x.data<float>() : row_major(x, gathered);
    if (scales.dtype() == float16)
      half_kernel(rows, M, K, w.data<uint32_t>(), scales.data<uint16_t>(), biases.data<uint16_t>(), N,
                  bits, group, out.data<float>());
    else
      kernel(rows, M, K, w.data<uint32_t>(), scales.data<float>(), biases.data<float>(), N, bits, group,
             out.data<float>());
  });
  taken.fetch_add(1, std::memory_order_relaxed);
}

bool write_slot(void **where, void *value) {
  long page = sysconf(_SC_PAGESIZE);
  auto start = reinterpret_cast<uintptr_t>(where) & ~static_cast<uintptr_t>(page - 1);
  if (mprotect(reinterpret_cast<void *>(start), page, PROT_READ | PROT_WRITE) != 0) return false;
  __atomic_store_n(where, value, __ATOMIC_SEQ_CST);
  mprotect(reinterpret_cast<void *>(start), page, PROT_READ);
  return true;
}

}  // namespace

extern "C" {

// 1: installed (or already); 0: the slot could not be found or written.
int tierlm_qmm_hook_install(void *kernel_fn, void *half_kernel_fn, void *supports_fn) {
  kernel = reinterpret_cast<Kernel>(kernel_fn);
  half_kernel = reinterpret_cast<HalfKernel>(half_kernel_fn);
  supports = reinterpret_cast<Supports>(supports_fn);
  if (slot) return 1;
  try {
    array x = zeros({1, 32}, float32, Device::cpu);
    auto parts = quantize(zeros({1, 32}, float32, Device::cpu), 32, 4, "affine", std::nullopt, Device::cpu);
    array y = quantized_matmul(x, parts[0], parts[1], parts[2], true, 32, 4, "affine", Device::cpu);
    if (!y.has_primitive() || std::strcmp(y.primitive().name(), "QuantizedMatmul") != 0) return 0;
    void **vtable = *reinterpret_cast<void ***>(&y.primitive());
    // A pointer to a virtual member holds 1 + the function's offset in the vtable (Itanium ABI).
    void (UnaryPrimitive::*member)(const std::vector<array> &, array &) = &UnaryPrimitive::eval_cpu;
    std::ptrdiff_t field;
    std::memcpy(&field, &member, sizeof field);
    if ((field & 1) != 1) return 0;
    void **where = vtable + (field - 1) / static_cast<std::ptrdiff_t>(sizeof(void *));
    auto previous = reinterpret_cast<EvalCpu>(*where);
    if (!write_slot(where, reinterpret_cast<void *>(&eval_cpu))) return 0;
    original = previous;
    slot = where;
    return 1;
  } catch (...) {
    return 0;
  }
}

// Puts MLX's own function back.
void tierlm_qmm_hook_remove(void) {
  if (slot && write_slot(slot, reinterpret_cast<void *>(original))) slot = nullptr;
}

// Products taken to qgemm.c, and left to MLX, since the process started.
unsigned long tierlm_qmm_hook_taken(void) { return taken.load(); }
unsigned long tierlm_qmm_hook_passed(void) { return passed.load(); }
}
