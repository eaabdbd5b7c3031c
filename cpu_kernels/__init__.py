"""Native attention kernels for XLA CPU (C++ through XLA's FFI), built on first use; imports nothing of the project."""
