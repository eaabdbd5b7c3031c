"""The engine's heap settings: blocks a step frees are reused by the next step without new pages."""
from __future__ import annotations

import ctypes
import ctypes.util
import resource

from jvllm.heap import release_freed_memory, reuse_freed_memory

LIBC = ctypes.CDLL(ctypes.util.find_library("c"))
LIBC.malloc.restype = ctypes.c_void_p
LIBC.malloc.argtypes = [ctypes.c_size_t]
LIBC.free.argtypes = [ctypes.c_void_p]
BLOCK = 64 << 20  # above glibc's largest mmap threshold (32 MB): by default a fresh mmap on every malloc


def _faults_of_a_written_block() -> int:
    """Minor page faults taken to allocate, write and free one BLOCK."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    pointer = LIBC.malloc(BLOCK)
    assert pointer
    ctypes.memset(pointer, 1, BLOCK)
    LIBC.free(pointer)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_a_freed_large_block_is_reused_without_faulting_its_pages_in_again():
    reuse_freed_memory()
    _faults_of_a_written_block()  # the heap grows once
    assert _faults_of_a_written_block() < BLOCK // 4096 // 10  # 16,384 pages: without reuse each is faulted again
    release_freed_memory()  # and an explicit trim still hands the memory back
