// cuda_runtime.h for the CPU simulator: everything lives in cuda_sim.h (force-included).
#ifndef MINIKV_CUDA_RUNTIME_H
#define MINIKV_CUDA_RUNTIME_H
#include "cuda_sim.h"
#endif
