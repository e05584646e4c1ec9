"""The CPU simulator: runs the unmodified CUDA C kernels of ``minikv_gpu/kernels`` on the CPU.

g++ compiles a .cu source against a small CUDA header (``include/cuda_sim.h``); every CUDA
thread runs as a fiber, blocks one after another. It checks logic (indexing, barriers, warp
collectives, argument types), not speed. See README.md in this folder.
"""

from .build import BuildOptions, cache_dir, define_flags
from .module import SimKernel, SimModule, check_launch_config, load_module
from .signature import KernelDecl, Param, check_args, find_kernels

__all__ = ["BuildOptions", "KernelDecl", "Param", "SimKernel", "SimModule", "cache_dir", "check_args",
           "check_launch_config", "define_flags", "find_kernels", "load_module"]
