"""MLX's own import of `cblas_sgemm`, pointed elsewhere.

MLX's Linux CPU build (`mlx[cpu]`) calls `cblas_sgemm` for every float32 matmul,
and calls it the way a shared library calls any function it imports: through a
slot of its global offset table (GOT), which the dynamic linker fills with the
address of the function it found (at the first call, or at load with `-z now`).
Writing another address into that slot sends MLX's later calls there, whatever
was imported first and whichever library the linker had bound; no other
library's calls move, and nothing has to be loaded with RTLD_GLOBAL.

The slot is found the way the dynamic linker finds it: the library's file is
read as ELF, and the relocations of its dynamic section (DT_JMPREL for calls
through the PLT, DT_RELA for the GLOB_DAT slots of code built with -fno-plt)
name, per slot, the symbol and the slot's offset from the library's load
address, which the linker's own list of loaded objects gives (dlinfo,
RTLD_DI_LINKMAP). Before writing, the slot must hold what the linker would have
put there: the function `dlsym` finds for that library, or, not yet bound, an
address inside the library (its lazy-binding stub). A library whose file no
longer matches what is mapped is left alone. A slot under RELRO (`-z now`
builds) is made writable for the one write and read-only again.

Nothing here proves that the calls now arrive: a library could stop calling
through the slot (a static BLAS, another symbol) and the slot would still be
written. The route's self-check (route.py) is what tells.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

# e_machine -> the relocation types of a slot the linker fills with a function's address
_SLOT_RELOCATIONS = {
    62: {7: "JUMP_SLOT", 6: "GLOB_DAT"},  # EM_X86_64
    183: {1026: "JUMP_SLOT", 1025: "GLOB_DAT"},  # EM_AARCH64
}
_PT_LOAD, _PT_DYNAMIC = 1, 2
_DT_NULL, _DT_PLTRELSZ, _DT_STRTAB, _DT_SYMTAB, _DT_RELA, _DT_RELASZ, _DT_JMPREL = 0, 2, 5, 6, 7, 8, 23
_RTLD_LAZY, _RTLD_NOLOAD, _RTLD_DI_LINKMAP = 0x1, 0x4, 2
_PROT_READ, _PROT_WRITE = 0x1, 0x2


class ElfError(ValueError):
    """The file is not an ELF library this module can read."""


class _LinkMap(ctypes.Structure):
    pass


_LinkMap._fields_ = [("l_addr", ctypes.c_size_t), ("l_name", ctypes.c_char_p), ("l_ld", ctypes.c_void_p),
                     ("l_next", ctypes.POINTER(_LinkMap)), ("l_prev", ctypes.POINTER(_LinkMap))]

_process: ctypes.CDLL | None = None


def _libc() -> ctypes.CDLL:
    """The process's own symbols (libc's, libdl's), declared on first use."""
    global _process
    if _process is None:
        process = ctypes.CDLL(None, use_errno=True)
        process.dlinfo.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
        process.dlsym.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        process.dlsym.restype = ctypes.c_void_p
        process.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _process = process
    return _process


@dataclass(frozen=True)
class LoadedObject:
    path: str  # as the dynamic linker names it
    base: int  # load bias: an address in the file's vaddr space plus this is its address here


@dataclass(frozen=True)
class Slot:
    """One GOT slot of `library` through which it calls `symbol`."""

    library: str
    symbol: str
    address: int  # of the slot, in this process
    kind: str  # JUMP_SLOT or GLOB_DAT
    span: tuple[int, int]  # the library's mapped addresses [start, end)

    def read(self) -> int:
        return ctypes.c_void_p.from_address(self.address).value or 0


def loaded_objects() -> list[LoadedObject]:
    """Every object the dynamic linker has loaded into this process, in its order."""
    link = ctypes.POINTER(_LinkMap)()
    if _libc().dlinfo(_libc()._handle, _RTLD_DI_LINKMAP, ctypes.byref(link)) != 0:
        return []
    objects = []
    while link:
        entry = link.contents
        if entry.l_name:
            objects.append(LoadedObject(entry.l_name.decode(errors="replace"), entry.l_addr))
        link = entry.l_next
    return objects


def _segments(data, header):
    (_, _, _, _, _, e_phoff, _, _, _, e_phentsize, e_phnum, _, _, _) = header
    return [struct.unpack_from("<IIQQQQQQ", data, e_phoff + i * e_phentsize) for i in range(e_phnum)]


def _offset(loads, vaddr: int) -> int:
    """The file offset of virtual address `vaddr`."""
    for _, _, p_offset, p_vaddr, _, p_filesz, _, _ in loads:
        if p_vaddr <= vaddr < p_vaddr + p_filesz:
            return p_offset + vaddr - p_vaddr
    raise ElfError(f"address {vaddr:#x} is in no loaded segment")


def slots_in(obj: LoadedObject, symbol: str) -> list[Slot]:
    """The GOT slots through which `obj` calls `symbol` (none when it does not import it)."""
    with open(obj.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
            raise ElfError(f"{obj.path}: not a little-endian 64-bit ELF file")
        header = struct.unpack_from("<16sHHIQQQIHHHHHH", data, 0)
        kinds = _SLOT_RELOCATIONS.get(header[2])
        if kinds is None:
            raise ElfError(f"{obj.path}: machine {header[2]} is not supported")
        segments = _segments(data, header)
        loads = [s for s in segments if s[0] == _PT_LOAD]
        dynamic = next((s for s in segments if s[0] == _PT_DYNAMIC), None)
        if dynamic is None or not loads:
            return []
        tags: dict[int, int] = {}
        for i in range(dynamic[5] // 16):  # p_filesz / sizeof(Elf64_Dyn)
            tag, value = struct.unpack_from("<qQ", data, dynamic[2] + 16 * i)
            if tag == _DT_NULL:
                break
            tags.setdefault(tag, value)
        if _DT_SYMTAB not in tags or _DT_STRTAB not in tags:
            return []
        symtab, strtab = _offset(loads, tags[_DT_SYMTAB]), _offset(loads, tags[_DT_STRTAB])
        wanted = symbol.encode() + b"\0"
        span = (obj.base + min(s[3] for s in loads), obj.base + max(s[3] + s[6] for s in loads))
        slots = []
        for table, size in ((_DT_JMPREL, _DT_PLTRELSZ), (_DT_RELA, _DT_RELASZ)):
            if table not in tags or not tags.get(size):
                continue
            start = _offset(loads, tags[table])
            for i in range(tags[size] // 24):  # sizeof(Elf64_Rela)
                r_offset, r_info, _ = struct.unpack_from("<QQq", data, start + 24 * i)
                kind, index = kinds.get(r_info & 0xFFFFFFFF), r_info >> 32
                if kind is None or index == 0:
                    continue
                name = struct.unpack_from("<I", data, symtab + 24 * index)[0]
                if data[strtab + name: strtab + name + len(wanted)] == wanted:
                    slots.append(Slot(obj.path, symbol, obj.base + r_offset, kind, span))
        return slots


def resolved(library: str, symbol: str) -> set[int]:
    """The addresses the dynamic linker may have bound `library`'s `symbol` to:
    the first definition in the global scope, and the first in the library's own."""
    found = {_libc().dlsym(_libc()._handle, symbol.encode())}
    try:
        own = ctypes.CDLL(library, mode=_RTLD_NOLOAD | _RTLD_LAZY)  # only if loaded: loads nothing
    except OSError:
        own = None
    if own is not None:
        found.add(_libc().dlsym(own._handle, symbol.encode()))
    return {a for a in found if a}


def _protection(address: int) -> str:
    """The permissions ('rw-p' etc.) of the mapping that holds `address`."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, perms = line.split()[:2]
        start, end = (int(x, 16) for x in span.split("-"))
        if start <= address < end:
            return perms
    raise OSError(f"{address:#x} is not mapped")


def write(slot: Slot, value: int) -> int:
    """Puts `value` in the slot with one aligned store; returns what it held."""
    cell = ctypes.c_void_p.from_address(slot.address)
    previous = cell.value or 0
    if "w" in _protection(slot.address):
        cell.value = value
        return previous
    page = slot.address & ~(mmap.PAGESIZE - 1)
    if _libc().mprotect(page, mmap.PAGESIZE, _PROT_READ | _PROT_WRITE) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mprotect of {slot.library}'s GOT: {os.strerror(errno)}")
    try:
        cell.value = value
    finally:
        _libc().mprotect(page, mmap.PAGESIZE, _PROT_READ)
    return previous


def expected(slot: Slot, also: set[int] = frozenset()) -> bool:
    """The slot holds what the dynamic linker put there (or one of `also`)."""
    value = slot.read()
    inside = slot.span[0] <= value < slot.span[1]  # not bound yet: the library's own lazy-binding stub
    return inside or value in also or value in resolved(slot.library, slot.symbol)
