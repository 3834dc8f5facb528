// tierlm's own MLX operations for the CPU: RMSNorm, RoPE, attention (over
// float32 or quantized KV), SwiGLU, GELU and the logits' log-sum-exp, each one
// node of MLX's graph instead of many (or instead of an evaluation that split
// the step's graph).
//
// On MLX's CPU device every operation costs a few microseconds whatever its
// size (perf: malloc, and MLX's stream thread woken through a futex for each
// task), and neither `mx.fast.rms_norm` nor `mx.fast.rope` has a CPU kernel:
// MLX builds their fallback graphs, 7 and 32 operations a call. A decode step
// of a small model is mostly that overhead. Here each is one primitive whose
// `eval_cpu` enqueues a plain loop on the stream's CPU encoder, as MLX's own
// primitives do; the graph stays lazy (no evaluation splits it).
//
// Python reaches these functions through ctypes with the addresses of its
// `mx.array` objects; `array_of` finds the C++ array inside one (nanobind's
// instance layout), and graph_ops.py proves that on known arrays at load, or
// leaves these operations off. The result goes into an array object the
// caller made (`*out = ...`), so no Python object is made here.
//
// Built against the headers and library of the installed mlx package
// (graph_ops.py), with floating-point contraction off: RoPE's products and sums
// are rounded one by one, as MLX's separate operations round them.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <stdexcept>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/backend/cpu/simd/simd.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

using namespace mlx::core;

namespace {

// nanobind's instance header (nb_internals.h, nanobind 2.x): PyObject_HEAD,
// then an int32 offset to the C++ object and a word of flags (bits 0-1 its
// state, 2 = ready; bit 2 "direct": the object sits at the offset, else a
// pointer to it does).
array *array_of(void *object) {
  auto *base = static_cast<char *>(object);
  int32_t offset;
  uint32_t flags;
  std::memcpy(&offset, base + 2 * sizeof(void *), sizeof offset);
  std::memcpy(&flags, base + 2 * sizeof(void *) + sizeof offset, sizeof flags);
  if ((flags & 3u) != 2u || offset <= 0 || offset > 4096) return nullptr;
  void *at = base + offset;
  return static_cast<array *>((flags & 4u) ? at : *static_cast<void **>(at));
}

// Element offsets of row r of `a` (every axis but the last), from its strides;
// `shape` may be wider than a's own (broadcast: a's missing or size-1 axes step 0).
int64_t row_offset(const array &a, const Shape &shape, int64_t r) {
  int64_t at = 0;
  int lead = static_cast<int>(shape.size()) - static_cast<int>(a.ndim());
  for (int axis = static_cast<int>(shape.size()) - 2; axis >= 0; axis--) {
    int64_t index = r % shape[axis];
    r /= shape[axis];
    int own = axis - lead;
    if (own >= 0 && a.shape(own) > 1) at += index * a.strides()[own];
  }
  return at;
}

int64_t rows_of(const Shape &shape) {
  int64_t rows = 1;
  for (size_t axis = 0; axis + 1 < shape.size(); axis++) rows *= shape[axis];
  return rows;
}

std::atomic<unsigned long> ran{0};

using Task = std::function<void(std::vector<array> &inputs, array &out)>;

// What each primitive here does in eval_cpu, as MLX's own CPU primitives do:
// the output's buffer, then its `task` enqueued on the stream's CPU encoder over
// weak copies of the arrays (the encoder keeps them alive until it has run).
class NativeOperation : public UnaryPrimitive {
 public:
  using UnaryPrimitive::UnaryPrimitive;

  void eval_cpu(const std::vector<array> &inputs, array &out) override {
    int from = donor();
    if (from >= 0 && takes_buffer_of(inputs[from], out)) out.copy_shared_buffer(inputs[from]);
    else out.set_data(allocator::malloc(out.nbytes()));
    auto &encoder = cpu::get_command_encoder(stream());
    std::vector<array> weak;
    for (const array &a : inputs) {
      encoder.set_input_array(a);
      weak.push_back(array::unsafe_weak_copy(a));
    }
    encoder.set_output_array(out);
    encoder.dispatch([task = task(), inputs = std::move(weak), out = array::unsafe_weak_copy(out)]() mutable {
      task(inputs, out);
      ran.fetch_add(1, std::memory_order_relaxed);
    });
  }
  void eval_gpu(const std::vector<array> &, array &) override { throw std::runtime_error("CPU only"); }

 protected:
  // the computation, its parameters captured by value (not `this`: the graph
  // may drop the primitive before the stream runs the task)
  virtual Task task() const = 0;
  // the input whose buffer the output may take over when nothing else holds it
  // (an element-wise operation then computes in place, as MLX's own unary ones
  // do), or -1
  virtual int donor() const { return -1; }

 private:
  static bool takes_buffer_of(const array &in, const array &out) {
    return in.is_donatable() && in.flags().row_contiguous && in.data_size() == in.size() &&
           in.nbytes() == out.nbytes();
  }
};

// x * rsqrt(mean(x^2) + eps) * weight over the last axis: each row's sum of
// squares in double, in order, so a row has the same bits alone or batched.
class RMSNormRows : public NativeOperation {
 public:
  RMSNormRows(Stream stream, float eps) : NativeOperation(stream), eps_(eps) {}
  const char *name() const override { return "TierlmRMSNorm"; }

 private:
  Task task() const override {
    return [eps = eps_](std::vector<array> &inputs, array &out) { compute(inputs[0], inputs[1], out, eps); };
  }

  static void compute(const array &x, const array &w, array &out, float eps) {
    const Shape &shape = x.shape();
    int64_t width = shape.back(), rows = rows_of(shape), step = x.strides().back(), w_step = w.strides()[0];
    const float *xs = x.data<float>(), *ws = w.data<float>();
    float *os = out.data<float>();
    for (int64_t r = 0; r < rows; r++) {
      const float *row = xs + row_offset(x, shape, r);
      double squares = 0;
      for (int64_t i = 0; i < width; i++) squares += static_cast<double>(row[i * step]) * row[i * step];
      float scale = 1.0f / std::sqrt(static_cast<float>(squares / width) + eps);
      float *to = os + r * width;
      for (int64_t i = 0; i < width; i++) to[i] = row[i * step] * scale * ws[i * w_step];
    }
  }

  float eps_;
};

// RoPE of (B, H, T, D) x, angles included, as rope.FewerOpsRoPE computes it
// with MLX's operations: position t + offset (a number, or one per batch entry
// from an int32 array), times `scale` unless 1, times each inverse frequency;
// their cosines and sines by MLX's own functions (simd/math.h, the header its
// CPU kernels are built from); pairs (i, i + dims / 2), or (2i, 2i + 1) when
// `traditional`, rotated; the values past `dims` copied. Each product and sum
// rounded on its own, as in MLX's separate operations.
class Rope : public NativeOperation {
 public:
  Rope(Stream stream, int dims, bool traditional, float scale, int offset)
      : NativeOperation(stream), dims_(dims), traditional_(traditional), scale_(scale), offset_(offset) {}
  const char *name() const override { return "TierlmRope"; }

 private:
  Task task() const override {
    return [dims = dims_, traditional = traditional_, scale = scale_, offset = offset_](std::vector<array> &inputs,
                                                                                       array &out) {
      compute(inputs, out, dims, traditional, scale, offset);
    };
  }

  static void compute(std::vector<array> &inputs, array &out, int dims, bool traditional, float scale, int offset) {
    const array &x = inputs[0], &inverse = inputs[1];
    const Shape &shape = x.shape();
    int64_t heads = shape[1], tokens = shape[2], width = shape[3], step = x.strides().back(), half = dims / 2;
    const float *xs = x.data<float>(), *frequencies = inverse.data<float>();
    float *os = out.data<float>();
    std::vector<float> cosines(tokens * half), sines(tokens * half);
    for (int64_t b = 0; b < shape[0]; b++) {
      float start = static_cast<float>(offset);
      if (inputs.size() == 3) {  // this entry's own offset
        const array &offsets = inputs[2];
        int64_t at = offsets.size() > 1 ? b * offsets.strides()[0] : 0;
        start = static_cast<float>(offsets.data<int32_t>()[at]);
      }
      if (b == 0 || inputs.size() == 3) angles(start, scale, frequencies, tokens, half, cosines, sines);
      for (int64_t h = 0; h < heads; h++)
        for (int64_t t = 0; t < tokens; t++) {
          int64_t r = (b * heads + h) * tokens + t;
          const float *row = xs + row_offset(x, shape, r), *c = &cosines[t * half], *s = &sines[t * half];
          float *to = os + r * width;
          for (int64_t i = 0; i < half; i++) {
            int64_t first = traditional ? 2 * i : i, second = traditional ? 2 * i + 1 : i + half;
            float u = row[first * step], v = row[second * step];
            float ac = u * c[i], bs = v * s[i], as = u * s[i], bc = v * c[i];
            to[first] = ac - bs;
            to[second] = as + bc;
          }
          for (int64_t i = dims; i < width; i++) to[i] = row[i * step];
        }
    }
  }

  static void angles(float start, float scale, const float *frequencies, int64_t tokens, int64_t half,
                     std::vector<float> &cosines, std::vector<float> &sines) {
    for (int64_t t = 0; t < tokens; t++) {
      float position = static_cast<float>(t) + start;
      if (scale != 1.0f) position = position * scale;
      for (int64_t i = 0; i < half; i++) {
        simd::Simd<float, 1> theta(position * frequencies[i]);
        cosines[t * half + i] = simd::cos(theta).value;
        sines[t * half + i] = simd::sin(theta).value;
      }
    }
  }

  int dims_;
  bool traditional_;
  float scale_;
  int offset_;
};

// tierlm_native's functions (set by tierlm_graph_set_kernels): the sgemm route
// MLX's matmuls reach (native/sgemm_route.c) and the row softmax (softmax.c).
using Sgemm = void (*)(int, int, int, int, int, int, float, const float *, int, const float *, int, float, float *,
                       int);
using SoftmaxRows = void (*)(float *, long, long, long);
using SoftmaxRowsMasked = void (*)(float *, long, long, const unsigned char *, long, long, long);
using PartFn = void (*)(void *arg, int part, int parts);
using ParallelChunks = void (*)(PartFn fn, void *arg, int chunks);
Sgemm sgemm = nullptr;
// exact_gemm.c's products over float16 B (a KV cache kept at float16): set
// only where the route sends attention's products to exact_gemm.c, so that
// they have the bits of the same products over float32 B
using HalfSgemm = int (*)(int, int, int, int, float, const float *, int, const uint16_t *, int, float, float *, int);
HalfSgemm half_sgemm = nullptr;
SoftmaxRows softmax_rows = nullptr;
SoftmaxRowsMasked softmax_rows_masked = nullptr;
ParallelChunks parallel_chunks = nullptr;  // threads.c's: each chunk whole on whichever core is free

// ... and its element-wise kernels (set by tierlm_graph_set_elementwise):
// SwiGLU in place into the gate, GELU (tanh approximation) into an output that
// may be its input (swiglu.c), and each row's log-sum-exp (softmax.c).
using SwiGLUKernel = void (*)(float *gate, const float *x, long n);
using GeluKernel = void (*)(const float *x, float *out, long n);
using LogSumExpKernel = void (*)(float *x, long rows, long cols, float *out);
SwiGLUKernel swiglu_kernel = nullptr;
GeluKernel gelu_kernel = nullptr;
LogSumExpKernel logsumexp_kernel = nullptr;

// a's elements row after row: its own buffer where it is row-contiguous, else
// gathered into `scratch` (a strided or broadcast view)
const float *row_major(const array &a, std::vector<float> &scratch) {
  if (a.flags().row_contiguous && a.data_size() == a.size()) return a.data<float>();
  const Shape &shape = a.shape();
  int64_t width = shape.back(), step = a.ndim() && a.shape(-1) > 1 ? a.strides().back() : 0;
  scratch.resize(a.size());
  for (int64_t r = 0, n = rows_of(shape); r < n; r++) {
    const float *row = a.data<float>() + row_offset(a, shape, r);
    for (int64_t i = 0; i < width; i++) scratch[r * width + i] = row[i * step];
  }
  return scratch.data();
}

// silu(gate) * x element by element, swiglu.c's kernel computing in place in
// the output (the gate's own buffer where MLX lets it go, else a copy of it):
// the same bits as kernels.native_swiglu, which evaluated the step's graph up
// to here first, once a layer.
class SwiGLU : public NativeOperation {
 public:
  using NativeOperation::NativeOperation;
  const char *name() const override { return "TierlmSwiGLU"; }

 private:
  int donor() const override { return 0; }
  Task task() const override {
    return [](std::vector<array> &inputs, array &out) {
      std::vector<float> gate_rows, x_rows;
      float *to = out.data<float>();
      const float *gate = row_major(inputs[0], gate_rows);
      if (gate != to) std::memcpy(to, gate, out.nbytes());
      swiglu_kernel(to, row_major(inputs[1], x_rows), static_cast<long>(out.size()));
    };
  }
};

// GELU (tanh approximation) element by element, swiglu.c's kernel: a
// decode step's activations too, which MLX's scalar tanh took before (the
// eager native_gelu split the graph, so only prompts took it).
class GeluApprox : public NativeOperation {
 public:
  using NativeOperation::NativeOperation;
  const char *name() const override { return "TierlmGelu"; }

 private:
  int donor() const override { return 0; }
  Task task() const override {
    return [](std::vector<array> &inputs, array &out) {
      std::vector<float> rows;
      gelu_kernel(row_major(inputs[0], rows), out.data<float>(), static_cast<long>(out.size()));
    };
  }
};

// log(sum(exp(x))) over the last axis of (rows, cols) float32, as (rows, 1):
// mlx-lm's normalization of each decode step's logits, in the graph (the eager
// native_logsumexp evaluated the whole step before the next could be queued).
class LogSumExpRows : public NativeOperation {
 public:
  using NativeOperation::NativeOperation;
  const char *name() const override { return "TierlmLogSumExp"; }

 private:
  Task task() const override {
    return [](std::vector<array> &inputs, array &out) {
      std::vector<float> rows;
      const array &x = inputs[0];
      logsumexp_kernel(const_cast<float *>(row_major(x, rows)), x.shape(0), x.shape(1), out.data<float>());
    };
  }
};
enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };

// Rows of keys or values a product reads: float32 (`f`) or float16 (`h`, a
// KV cache kept at float16, read as it is), `ld` values apart.
struct KVRowsAt {
  const float *f = nullptr;
  const uint16_t *h = nullptr;
  int64_t ld = 0;
};

// Rows [0, rows) of the last two axes of (A, B, rows, width) `a` (float32 or
// float16) at (i, j), where they are; copied into `scratch` as float32 when its
// last axis is not contiguous.
KVRowsAt rows_at(const array &a, int i, int j, std::vector<float> &scratch) {
  size_t at = (a.shape(0) > 1 ? i * a.strides()[0] : 0) + j * a.strides()[1];
  int64_t rows = a.shape(2), width = a.shape(3), step = a.strides()[3];
  bool half = a.dtype() == float16;
  if (step == 1 && (rows == 1 || a.strides()[2] >= width)) {
    int64_t ld = rows == 1 ? width : a.strides()[2];
    return half ? KVRowsAt{nullptr, a.data<uint16_t>() + at, ld} : KVRowsAt{a.data<float>() + at, nullptr, ld};
  }
  scratch.resize(rows * width);
  for (int64_t r = 0; r < rows; r++)
    for (int64_t c = 0; c < width; c++) {
      size_t e = at + r * a.strides()[2] + c * step;
      scratch[r * width + c] = half ? static_cast<float>(a.data<float16_t>()[e]) : a.data<float>()[e];
    }
  return KVRowsAt{scratch.data(), nullptr, width};
}

// the rows of one sequence's (b) KV head (h): keys or values
using KVRows = std::function<KVRowsAt(int b, int h, std::vector<float> &scratch)>;
void attend(std::vector<array> &inputs, array &out, float scale, bool causal, int width, const array *mask_array,
            const KVRows &keys_at, const KVRows &values_at);

// softmax(q k^T * scale + mask) v for (B, H, L, D) queries and (B, KV, S, D)
// keys and values, as kernels.attention computes it where the native kernels
// run, bit for bit: the queries times the scale, each KV head's group of query
// heads times its keys through the sgemm route (as MLX's matmul calls it), the
// native row softmax over all the scores at once (under a (B or 1, 1, L, S)
// boolean mask, or causal, or neither), the weighted values through the route.
class Attention : public NativeOperation {
 public:
  Attention(Stream stream, float scale, bool causal) : NativeOperation(stream), scale_(scale), causal_(causal) {}
  const char *name() const override { return "TierlmAttention"; }

 private:
  Task task() const override {
    return [scale = scale_, causal = causal_](std::vector<array> &inputs, array &out) {
      compute(inputs, out, scale, causal);
    };
  }

  static void compute(std::vector<array> &inputs, array &out, float scale, bool causal) {
    const array &k = inputs[1], &v = inputs[2];
    attend(inputs, out, scale, causal, v.shape(3), inputs.size() == 4 ? &inputs[3] : nullptr,
           [&](int b, int h, std::vector<float> &scratch) { return rows_at(k, b, h, scratch); },
           [&](int b, int h, std::vector<float> &scratch) { return rows_at(v, b, h, scratch); });
  }

  float scale_;
  bool causal_;
};

// Products of fewer multiply-adds than this exact_gemm.c computes on one core
// (its PARALLEL_MIN_FMAS).
constexpr int64_t SHARED_PRODUCT_FMAS = int64_t{1} << 21;
// Below this many query rows a pair (a decode step's, a draft's check's) does
// not share well inside: exact_gemm.c shares the weighted sums by groups of 6
// rows, so a group of 7 query heads ran 6 rows on one core and 1 on the
// other, both reading all the values.
constexpr int FEW_ROWS = 64;
// ... and below this many a pair is done before another core would start on one.
constexpr int64_t SHARED_PAIR_MIN_FMAS = int64_t{1} << 15;

// Whether attention shares its (sequence, KV head) pairs over the cores (else
// each pair's products share themselves where they are big): for few query
// rows or small products, not tiny ones, and only where the route sends them to
// exact_gemm.c (head and value widths it takes), so no other BLAS is called
// from several threads.
bool shares_pairs(int rows, int span, int width) {
  int64_t fmas = static_cast<int64_t>(rows) * span * width;
  return parallel_chunks != nullptr && width <= 512 && fmas >= SHARED_PAIR_MIN_FMAS &&
         (rows < FEW_ROWS || fmas < SHARED_PRODUCT_FMAS);
}

// The KV rows one pair's product reads where they must be copied first (a
// strided cache, KV kept at 8 or 4 bits): one buffer a thread, kept between
// calls (a fresh one the size of a long context's KV head would fault its
// pages in anew each time); it holds one KV head of the longest context seen.
thread_local std::vector<float> pair_scratch;

// body(pair) for pair in [0, pairs): over the cores when `share` (each pair
// whole on one thread, its products in their one order: no bit moves), else
// in order here. An exception in any pair (the scratch's allocation) is thrown
// here once every pair is done, not on a helper thread.
void for_each_pair(int pairs, bool share, const std::function<void(int)> &body) {
  if (!share || pairs < 2) {
    for (int pair = 0; pair < pairs; pair++) body(pair);
    return;
  }
  struct Job {
    const std::function<void(int)> &body;
    std::mutex lock;
    std::exception_ptr failed;
  } job{body, {}, nullptr};
  parallel_chunks(
      [](void *arg, int chunk, int) {
        auto *job = static_cast<Job *>(arg);
        try {
          job->body(chunk);
        } catch (...) {
          std::lock_guard<std::mutex> hold(job->lock);
          if (!job->failed) job->failed = std::current_exception();
        }
      },
      &job, pairs);
  if (job.failed) std::rethrow_exception(job.failed);
}

// C (m x n) = A (m x k) . B (k x n), or . B^T (B n x k) when `trans_b`: the
// route's sgemm for float32 B, exact_gemm.c's own for float16 (which
// tierlm_graph_attention only lets in where that takes the product).
void product(bool trans_b, int m, int n, int k, const float *a, int lda, const KVRowsAt &b, float *c, int ldc) {
  int ldb = static_cast<int>(b.ld);
  if (b.h) {
    if (!half_sgemm(trans_b, m, n, k, 1.0f, a, lda, b.h, ldb, 0.0f, c, ldc))
      throw std::runtime_error("exact_gemm.c did not take a product over float16 KV");
    return;
  }
  sgemm(ROW_MAJOR, NO_TRANS, trans_b ? TRANS : NO_TRANS, m, n, k, 1.0f, a, lda, b.f, ldb, 0.0f, c, ldc);
}

// Attention as above, the keys and values of each (sequence, KV head) read
// through `keys_at` and `values_at` (`width` values a row), under `mask` (a
// boolean (B or 1, 1, L, S) array), or causal, or neither.
void attend(std::vector<array> &inputs, array &out, float scale, bool causal, int width, const array *mask_array,
          const KVRows &keys_at, const KVRows &values_at) {
  const array &q = inputs[0];
  int batch = q.shape(0), heads = q.shape(1), length = q.shape(2), dim = q.shape(3);
  int kv_heads = inputs[1].shape(1), span = inputs[1].shape(2), group = heads / kv_heads;
  // the queries times the scale, row-major (B, H, L, D): MLX's product, element by element
  // not zeroed first: every element is written before it is read
  std::unique_ptr<float[]> queries(new float[static_cast<size_t>(batch) * heads * length * dim]);
  Shape shape = q.shape();
  const float *qs = q.data<float>();
  for (int64_t r = 0, rows = rows_of(shape); r < rows; r++) {
    const float *row = qs + row_offset(q, shape, r);
    for (int d = 0; d < dim; d++) queries[r * dim + d] = row[d * q.strides()[3]] * scale;
  }
  std::unique_ptr<float[]> scores(new float[static_cast<size_t>(batch) * heads * length * span]);
  int m = group * length;
  bool share = shares_pairs(m, span, std::max(dim, width));
  for_each_pair(batch * kv_heads, share, [&](int pair) {
    int b = pair / kv_heads, h = pair % kv_heads;
    size_t first = (static_cast<size_t>(b) * heads + h * group) * length;
    product(true, m, span, dim, queries.get() + first * dim, dim, keys_at(b, h, pair_scratch),
            scores.get() + first * span, span);
  });
  long rows = static_cast<long>(batch) * heads * length;
  if (mask_array != nullptr) {
    const array &mask = *mask_array;
    int mask_batch = mask.shape(0) > 1;
    std::vector<unsigned char> bits(static_cast<size_t>(mask.shape(0)) * length * span);
    Shape mask_shape = mask.shape();
    for (int64_t r = 0, n = rows_of(mask_shape); r < n; r++) {
      const bool *row = mask.data<bool>() + row_offset(mask, mask_shape, r);
      for (int c = 0; c < span; c++) bits[r * span + c] = row[c * mask.strides()[3]];
    }
    softmax_rows_masked(scores.get(), rows, span, bits.data(), heads, length, mask_batch);
  } else {
    softmax_rows(scores.get(), rows, span, causal ? length : 0);
  }
  float *to = out.data<float>();
  for_each_pair(batch * kv_heads, share, [&](int pair) {
    int b = pair / kv_heads, h = pair % kv_heads;
    size_t first = (static_cast<size_t>(b) * heads + h * group) * length;
    product(false, m, width, span, scores.get() + first * span, span, values_at(b, h, pair_scratch),
            to + first * width, width);
  });
}

// One group of 64 codes (`bytes`, MLX's packing: code e in the lowest bits
// first) as float32: each code times the scale, plus the bias, rounded one by
// one as kv_float32's MLX operations round them (no contraction: see the top).
// Cloned for AVX-512 and AVX2 (picked at load by the CPU) and built at -O3
// (GCC 12's -O2 leaves these loops scalar), so they run 8 codes an
// instruction; the build's own target is plain x86-64.
__attribute__((target_clones("avx512f", "avx2", "default"), optimize("O3", "fp-contract=off")))
void dequantize_8bit_group(const uint8_t *__restrict bytes, float scale, float bias, float *__restrict to) {
  for (int e = 0; e < 64; e++) to[e] = static_cast<float>(bytes[e]) * scale + bias;
}

__attribute__((target_clones("avx512f", "avx2", "default"), optimize("O3", "fp-contract=off")))
void dequantize_4bit_group(const uint8_t *__restrict bytes, float scale, float bias, float *__restrict to) {
  float low[32], high[32];
  for (int i = 0; i < 32; i++) {
    low[i] = static_cast<float>(bytes[i] & 15u) * scale + bias;
    high[i] = static_cast<float>(bytes[i] >> 4) * scale + bias;
  }
  for (int i = 0; i < 32; i++) {
    to[2 * i] = low[i];
    to[2 * i + 1] = high[i];
  }
}

// One sequence's (i) KV head's (j) rows of KV kept at `bits` in groups of
// `group` (MLX's affine (codes, scales, biases), float32 scales: the CPU's KV
// dtype), as float32 in `scratch`: each code as a float, times its group's
// scale, plus its bias, as kv_float32 computes it (dequantize.py). A slab at a
// time, so the product reads it from the cache, not from memory.
KVRowsAt dequantized_at(const array &codes, const array &scales, const array &biases, int i, int j, int group,
                        int bits, std::vector<float> &scratch) {
  int64_t rows = codes.shape(2), width = codes.shape(3) * 32 / bits, groups = width / group;
  auto at = [i, j](const array &a) { return (a.shape(0) > 1 ? i * a.strides()[0] : 0) + j * a.strides()[1]; };
  const uint32_t *c = codes.data<uint32_t>() + at(codes);
  const float *s = scales.data<float>() + at(scales), *z = biases.data<float>() + at(biases);
  int64_t c_row = codes.strides()[2], s_row = scales.strides()[2], z_row = biases.strides()[2];
  int per_word = 32 / bits;
  uint32_t levels = (1u << bits) - 1u;
  bool fast = group == 64 && (bits == 8 || bits == 4);
  scratch.resize(static_cast<size_t>(rows) * width);
  for (int64_t r = 0; r < rows; r++) {
    float *to = scratch.data() + r * width;
    const uint32_t *words = c + r * c_row;
    for (int64_t g = 0; g < groups; g++) {
      float scale = s[r * s_row + g], bias = z[r * z_row + g];
      if (fast) {
        const uint8_t *bytes = reinterpret_cast<const uint8_t *>(words) + g * 64 * bits / 8;
        (bits == 8 ? dequantize_8bit_group : dequantize_4bit_group)(bytes, scale, bias, to + g * 64);
        continue;
      }
      for (int64_t e = g * group; e < (g + 1) * group; e++) {
        uint32_t code = (words[e / per_word] >> ((e % per_word) * bits)) & levels;
        to[e] = static_cast<float>(code) * scale + bias;
      }
    }
  }
  return KVRowsAt{scratch.data(), nullptr, width};
}

// Attention (as Attention) over KV kept at 8 or 4 bits: inputs q, then the
// keys' and the values' (codes, scales, biases), then the mask if any. Each
// (sequence, KV head) is dequantized just before its product, into a scratch
// the product then reads from the cache: the whole context's KV as float32 (a
// copy four times its size, written and read back a layer at a time) is never made.
class QuantizedKVAttention : public NativeOperation {
 public:
  QuantizedKVAttention(Stream stream, float scale, bool causal, int group, int bits)
      : NativeOperation(stream), scale_(scale), causal_(causal), group_(group), bits_(bits) {}
  const char *name() const override { return "TierlmQuantizedKVAttention"; }

 private:
  Task task() const override {
    return [scale = scale_, causal = causal_, group = group_, bits = bits_](std::vector<array> &inputs, array &out) {
      const array &kc = inputs[1], &ks = inputs[2], &kb = inputs[3], &vc = inputs[4], &vs = inputs[5], &vb = inputs[6];
      attend(inputs, out, scale, causal, vc.shape(3) * 32 / bits, inputs.size() == 8 ? &inputs[7] : nullptr,
             [&](int b, int h, std::vector<float> &scratch) {
               return dequantized_at(kc, ks, kb, b, h, group, bits, scratch);
             },
             [&](int b, int h, std::vector<float> &scratch) {
               return dequantized_at(vc, vs, vb, b, h, group, bits, scratch);
             });
    };
  }

  float scale_;
  bool causal_;
  int group_, bits_;
};

// A QuantizedMatmul primitive (affine, transposed) of `group` and `bits` on
// `stream`, one per kind, shared by the arrays made with it (it keeps no state
// of its own). MLX does not export the class's vtable, so the first of each
// is taken from a tiny product made through MLX's public quantized_matmul.
std::shared_ptr<Primitive> quantized_matmul_primitive(Stream stream, int group, int bits) {
  static std::mutex lock;
  static std::map<std::tuple<int, int, int>, std::shared_ptr<Primitive>> made;
  std::lock_guard<std::mutex> hold(lock);
  auto key = std::make_tuple(stream.index, group, bits);
  auto found = made.find(key);
  if (found != made.end()) return found->second;
  auto parts = quantize(zeros({1, group}, float32, stream), group, bits, "affine", std::nullopt, stream);
  array product = quantized_matmul(zeros({1, group}, float32, stream), parts[0], parts[1], parts[2], true, group,
                                   bits, "affine", stream);
  if (!product.has_primitive() || std::strcmp(product.primitive().name(), "QuantizedMatmul") != 0)
    throw std::runtime_error("MLX's quantized_matmul made no QuantizedMatmul");
  return made[key] = product.primitive_ptr();
}

// a float32 array of at least one axis
bool float32_array(const array *a) { return a != nullptr && a->dtype() == float32 && a->ndim() >= 1; }

// keys and values attention reads: both float32, or both float16 where
// exact_gemm.c takes their products (half_sgemm, widths up to its 512)
bool takes_kv(const array *k, const array *v) {
  if (float32_array(k) && float32_array(v)) return true;
  return half_sgemm != nullptr && k != nullptr && v != nullptr && k->dtype() == float16 && v->dtype() == float16 &&
         k->ndim() == 4 && v->ndim() == 4 && k->shape(3) <= 512 && v->shape(3) <= 512;
}

// an attention mask the native softmax reads: booleans (B or 1, 1, L, S) for
// queries q (B, H, L, D) over `span` keys
bool takes_mask(const array &mask, const array &q, int span) {
  return mask.dtype() == bool_ && mask.ndim() == 4 && (mask.shape(0) == 1 || mask.shape(0) == q.shape(0)) &&
         mask.shape(1) == 1 && mask.shape(2) == q.shape(2) && mask.shape(3) == span;
}

// a float32 array of `shape` that an Operation(this thread's default stream,
// args...) computes from `inputs`, lazy, into *out: 0, or 2 where MLX refused
template <class Operation, class... Args>
int lazy(array *out, Shape shape, std::vector<array> inputs, Args... args) {
  try {
    *out = array(std::move(shape), float32, std::make_shared<Operation>(to_stream({}), args...), std::move(inputs));
    return 0;
  } catch (...) {
    return 2;
  }
}

}  // namespace

extern "C" {

// The array inside a Python mx.array at `object`: its dimensions into shape
// (up to 8), its element size in bytes; -1 when none is found there.
int tierlm_graph_probe(void *object, int64_t *shape, int *element_bytes) {
  array *a = array_of(object);
  if (a == nullptr || a->ndim() > 8) return -1;
  for (size_t i = 0; i < a->ndim(); i++) shape[i] = a->shape(static_cast<int>(i));
  *element_bytes = static_cast<int>(a->itemsize());
  return static_cast<int>(a->ndim());
}

// *out = RMSNorm of x by weight (float32, weight 1-D as wide as x's last
// axis), lazy, on this thread's default stream. 0: done; 1: inputs it does not
// take (the caller computes it otherwise); 2: MLX refused.
int tierlm_graph_rms_norm(void *x_object, void *weight_object, void *out_object, float eps) {
  array *x = array_of(x_object), *w = array_of(weight_object), *out = array_of(out_object);
  if (!float32_array(x) || !float32_array(w) || out == nullptr || w->ndim() != 1 || w->shape(0) != x->shape(-1))
    return 1;
  return lazy<RMSNormRows>(out, x->shape(), {*x, *w}, eps);
}

// *out = RoPE of float32 x (B, H, T, D) with `inverse` the float32 inverse
// frequencies (dims / 2), at `offset`, or at each batch entry's offset in the
// int32 (B,) array at offsets_object when it is not NULL; lazy. Return codes as above.
int tierlm_graph_rope(void *x_object, void *inverse_object, void *offsets_object, void *out_object, int dims,
                      int traditional, float scale, int offset) {
  array *x = array_of(x_object), *inverse = array_of(inverse_object), *out = array_of(out_object);
  array *offsets = offsets_object ? array_of(offsets_object) : nullptr;
  if (!float32_array(x) || !float32_array(inverse) || out == nullptr || x->ndim() != 4 || dims <= 0 ||
      dims % 2 || dims > x->shape(3) || inverse->ndim() != 1 || inverse->shape(0) != dims / 2 ||
      (offsets_object && offsets == nullptr))
    return 1;
  std::vector<array> inputs = {*x, *inverse};
  if (offsets) {
    if (offsets->dtype() != int32 || offsets->ndim() > 1 || (offsets->size() != 1 && offsets->size() != x->shape(0)))
      return 1;
    inputs.push_back(*offsets);
  }
  return lazy<Rope>(out, x->shape(), std::move(inputs), dims, traditional != 0, scale, offset);
}

void tierlm_graph_set_kernels(void *route_sgemm, void *rows, void *rows_masked, void *chunks, void *exact_half) {
  sgemm = reinterpret_cast<Sgemm>(route_sgemm);
  half_sgemm = reinterpret_cast<HalfSgemm>(exact_half);
  softmax_rows = reinterpret_cast<SoftmaxRows>(rows);
  softmax_rows_masked = reinterpret_cast<SoftmaxRowsMasked>(rows_masked);
  parallel_chunks = reinterpret_cast<ParallelChunks>(chunks);
}

void tierlm_graph_set_elementwise(void *swiglu, void *gelu_approx, void *logsumexp_rows) {
  swiglu_kernel = reinterpret_cast<SwiGLUKernel>(swiglu);
  gelu_kernel = reinterpret_cast<GeluKernel>(gelu_approx);
  logsumexp_kernel = reinterpret_cast<LogSumExpKernel>(logsumexp_rows);
}

// *out = silu(gate) * x of float32 arrays of one shape, lazy. Return codes as above.
int tierlm_graph_swiglu(void *gate_object, void *x_object, void *out_object) {
  array *gate = array_of(gate_object), *x = array_of(x_object), *out = array_of(out_object);
  if (!swiglu_kernel || !float32_array(gate) || !float32_array(x) || out == nullptr || gate->shape() != x->shape())
    return 1;
  return lazy<SwiGLU>(out, gate->shape(), {*gate, *x});
}

// *out = GELU (tanh approximation) of float32 x, lazy. Return codes as above.
int tierlm_graph_gelu_approx(void *x_object, void *out_object) {
  array *x = array_of(x_object), *out = array_of(out_object);
  if (!gelu_kernel || !float32_array(x) || out == nullptr) return 1;
  return lazy<GeluApprox>(out, x->shape(), {*x});
}

// *out = the log-sum-exp of each row of float32 (rows, cols) x, as (rows, 1), lazy.
// Return codes as above.
int tierlm_graph_logsumexp(void *x_object, void *out_object) {
  array *x = array_of(x_object), *out = array_of(out_object);
  if (!logsumexp_kernel || !float32_array(x) || x->ndim() != 2 || x->shape(1) == 0 || out == nullptr) return 1;
  return lazy<LogSumExpRows>(out, {x->shape(0), 1}, {*x});
}

// *out = attention of float32 q (B, H, L, D), k (B, KV, S, D), v (B, KV, S,
// Dv) (k and v float32, or both float16: takes_kv) with mask_object a boolean (B or 1, 1, L, S) array, or NULL (then
// `causal` or no mask), lazy. Return codes as above.
int tierlm_graph_attention(void *q_object, void *k_object, void *v_object, void *mask_object, void *out_object,
                           float scale, int causal) {
  array *q = array_of(q_object), *k = array_of(k_object), *v = array_of(v_object), *out = array_of(out_object);
  array *mask = mask_object ? array_of(mask_object) : nullptr;
  if (!sgemm || !float32_array(q) || !takes_kv(k, v) || out == nullptr ||
      q->ndim() != 4 || k->ndim() != 4 || v->ndim() != 4 || k->shape(1) == 0 || q->shape(1) % k->shape(1) ||
      k->shape(0) != q->shape(0) || v->shape(0) != q->shape(0) || k->shape(1) != v->shape(1) ||
      k->shape(2) != v->shape(2) || k->shape(3) != q->shape(3) || (mask_object && mask == nullptr))
    return 1;
  std::vector<array> inputs = {*q, *k, *v};
  if (mask) {
    if (!takes_mask(*mask, *q, k->shape(2))) return 1;
    inputs.push_back(*mask);
  }
  Shape shape = q->shape();
  shape.back() = v->shape(3);
  return lazy<Attention>(out, shape, std::move(inputs), scale, causal != 0 && !mask);
}

// *out = attention (as tierlm_graph_attention) of float32 q (B, H, L, D) over
// keys and values kept at `bits` in groups of `group`: each MLX's affine
// (uint32 codes (B, KV, S, D * bits / 32), float32 scales and biases (B, KV,
// S, D / group)), lazy. Return codes as above.
int tierlm_graph_quantized_attention(void *q_object, void *const *keys_objects, void *const *values_objects,
                                     void *mask_object, void *out_object, float scale, int causal, int group,
                                     int bits) {
  array *q = array_of(q_object), *out = array_of(out_object);
  array *mask = mask_object ? array_of(mask_object) : nullptr;
  std::vector<array> inputs;
  if (!sgemm || !float32_array(q) || q->ndim() != 4 || out == nullptr || (mask_object && mask == nullptr) ||
      bits <= 0 || 32 % bits || group <= 0 || q->shape(3) % group)
    return 1;
  inputs.push_back(*q);
  for (void *const *triple : {keys_objects, values_objects}) {
    array *codes = array_of(triple[0]), *scales = array_of(triple[1]), *biases = array_of(triple[2]);
    if (codes == nullptr || scales == nullptr || biases == nullptr || codes->dtype() != uint32 ||
        scales->dtype() != float32 || biases->dtype() != float32 || codes->ndim() != 4 || scales->ndim() != 4 ||
        scales->shape() != biases->shape() || codes->shape(0) != q->shape(0) || codes->shape(1) == 0 ||
        q->shape(1) % codes->shape(1) || static_cast<int64_t>(codes->shape(3)) * 32 / bits != q->shape(3) ||
        scales->shape(0) != codes->shape(0) || scales->shape(1) != codes->shape(1) ||
        scales->shape(2) != codes->shape(2) || static_cast<int64_t>(scales->shape(3)) * group != q->shape(3) ||
        codes->strides()[3] != 1 || scales->strides()[3] != 1 || biases->strides()[3] != 1)
      return 1;
    inputs.insert(inputs.end(), {*codes, *scales, *biases});
  }
  if (inputs[1].shape() != inputs[4].shape()) return 1;
  if (mask) {
    if (!takes_mask(*mask, *q, inputs[1].shape(2))) return 1;
    inputs.push_back(*mask);
  }
  return lazy<QuantizedKVAttention>(out, q->shape(), std::move(inputs), scale, causal != 0 && !mask, group, bits);
}

// *out = float32 x (..., K) times the affine-quantized uint32 w (N x K packed)
// transposed, with float16 scales and biases (N x K / group), lazy: MLX's own
// QuantizedMatmul primitive, made here because MLX's quantized_matmul would
// first widen the scales to x's dtype, a pass over all of them every call.
// qmm_hook.cpp computes it (qgemm.c reads float16 scales as they are); the
// caller makes one only for products the hook takes. Return codes as above.
int tierlm_graph_qmm(void *x_object, void *w_object, void *scales_object, void *biases_object, void *out_object,
                     int group, int bits) {
  array *x = array_of(x_object), *w = array_of(w_object), *out = array_of(out_object);
  array *scales = array_of(scales_object), *biases = array_of(biases_object);
  if (!float32_array(x) || w == nullptr || scales == nullptr || biases == nullptr || out == nullptr ||
      w->dtype() != uint32 || w->ndim() != 2 || scales->dtype() != float16 || biases->dtype() != float16 ||
      scales->shape() != biases->shape() || scales->ndim() != 2 || group <= 0 || bits <= 0 ||
      x->shape(-1) != static_cast<int64_t>(w->shape(1)) * 32 / bits || scales->shape(0) != w->shape(0) ||
      static_cast<int64_t>(scales->shape(1)) * group != x->shape(-1))
    return 1;
  Shape shape = x->shape();
  shape.back() = w->shape(0);
  try {
    *out = array(shape, float32, quantized_matmul_primitive(to_stream({}), group, bits), {*x, *w, *scales, *biases});
    return 0;
  } catch (...) {
    return 2;
  }
}

// Operations these primitives computed since the process started.
unsigned long tierlm_graph_ran(void) { return ran.load(); }
}
