"""Raw memory helpers shared by the backends: byte views of tensors and of addresses, libc calls."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os

import torch

__all__ = ["byte_tensor", "copy", "libc", "map_fd", "ptr_memoryview", "ptr_tensor", "unmap"]

libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
libc.munmap.restype = ctypes.c_int
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
MAP_POPULATE = 0x8000
MAP_FIXED = 0x10


def byte_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes as a flat uint8 tensor sharing its memory (contiguous tensors only)."""
    return tensor.reshape(-1).view(torch.uint8)


def ptr_memoryview(addr: int, nbytes: int) -> memoryview:
    """A writable byte memoryview of ``nbytes`` at ``addr`` (the caller keeps it mapped)."""
    return memoryview((ctypes.c_char * nbytes).from_address(addr)).cast("B")


def ptr_tensor(addr: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over ``nbytes`` at ``addr`` (no copy; the caller keeps it mapped)."""
    return torch.frombuffer((ctypes.c_char * nbytes).from_address(addr), dtype=torch.uint8)


_SMALL = 64 * 1024
"""Below this a single-threaded memmove beats torch's dispatch overhead."""


def copy(dst: int, src: int, nbytes: int) -> None:
    """memcpy between two addresses; large copies use torch's (parallel) copy."""
    if nbytes <= _SMALL:
        ctypes.memmove(dst, src, nbytes)
    else:
        ptr_tensor(dst, nbytes).copy_(ptr_tensor(src, nbytes))


def map_fd(fd: int, nbytes: int, *, addr: int = 0, populate: bool = True) -> int:
    """mmap ``fd`` shared read-write; at exactly ``addr`` when given (replacing what is there)."""
    flags = mmap.MAP_SHARED | (MAP_POPULATE if populate else 0) | (MAP_FIXED if addr else 0)
    got = libc.mmap(addr or None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0)
    if got is None or got == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap failed: {os.strerror(err)}")
    if addr and got != addr:
        raise OSError(0, f"mmap placed the mapping at {got:#x}, not {addr:#x}")
    return int(got)


def map_anonymous(addr: int, nbytes: int) -> None:
    """Replaces ``[addr, addr+nbytes)`` with fresh private anonymous pages."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_FIXED
    got = libc.mmap(addr, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
    if got != addr:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap failed: {os.strerror(err)}")


def unmap(addr: int, nbytes: int) -> None:
    libc.munmap(addr, nbytes)
