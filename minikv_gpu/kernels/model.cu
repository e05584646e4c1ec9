// model.cu: the element-wise and row-wise building blocks of the Llama-style
// decoder (minikv/model.py): RMSNorm, RoPE in both pair layouts, SwiGLU and GeGLU (Gemma).
// Matrix products are not here: minikv_gpu.model calls xp.matmul (cuBLAS).
//
// All activations are float32 and row-major. N = packed tokens, H = hidden
// size, D = head_dim, I = MLP width. Launch scalars are int32/float32.
//
// Every kernel is memory-bound: each input element is read once and each
// output element written once, so the byte counts below are also the floor.

// Sum over the 32 lanes of a warp; every lane gets the total.
__device__ __forceinline__ float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

// ---------------------------------------------------------------------------
// rms_norm_v1: out[n, :] = x[n, :] / sqrt(mean(x[n, :]^2) + eps) * w[:]
//
//   grid  = (N)          one block per row
//   block = (256)        any multiple of 32 up to 1024 works
//   shared: 32 floats (one partial sum per warp), static
//   bytes: reads 4*N*H (x) + 4*H*N (w, from L1/L2 after the first row),
//          writes 4*N*H.
//
// Each thread strides over the row summing squares, the warp reduces with
// shuffles, warp 0 reduces the per-warp sums. x and out must not alias: x is
// __restrict__ (so its loads may go through the read-only path), and writing
// through an alias of a __restrict__ pointer is undefined behaviour. The caller,
// minikv_gpu.model.rms_norm, always writes to a new array.
// ---------------------------------------------------------------------------
extern "C" __global__ void rms_norm_v1(const float* __restrict__ x, const float* __restrict__ w,
                                       float* out, int n_rows, int hidden, float eps) {
    __shared__ float warp_sums[32];
    __shared__ float inv_rms;
    const int row = blockIdx.x;
    if (row >= n_rows) return;  // uniform per block: no barrier is skipped by only some threads
    const float* xr = x + (long long)row * hidden;
    float* outr = out + (long long)row * hidden;

    float ss = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) ss += xr[i] * xr[i];
    ss = warp_sum(ss);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = (blockDim.x + 31) >> 5;
    if (lane == 0) warp_sums[warp] = ss;
    __syncthreads();
    if (warp == 0) {
        float total = lane < n_warps ? warp_sums[lane] : 0.0f;
        total = warp_sum(total);
        if (lane == 0) inv_rms = 1.0f / sqrtf(total / (float)hidden + eps);
    }
    __syncthreads();
    const float r = inv_rms;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) outr[i] = xr[i] * r * w[i];
}

// ---------------------------------------------------------------------------
// rope_v1: rotate pairs of dimensions of x[n, head, :] by the angles of token n.
//
//   x, out: [N, heads, D] float32 (may alias: each thread owns one pair)
//   cos, sin: [N, D/2] float32, already gathered at each token's position
//   half_layout = 0: pairs (2i, 2i+1)       GGUF / llama.cpp "interleaved"
//   half_layout = 1: pairs (i, i + D/2)     transformers "rotate_half"
//
//   grid  = (ceil(N*heads*D/2 / 256))   one thread per pair
//   block = (256)
//   bytes: reads 4*N*heads*D (x) + 8*N*D/2 (cos, sin), writes 4*N*heads*D.
//
// (a, b) -> (a cos t - b sin t, b cos t + a sin t), pair i at angle pos*theta^(-2i/D).
// ---------------------------------------------------------------------------
extern "C" __global__ void rope_v1(const float* x, float* out, const float* __restrict__ cos_t,
                                   const float* __restrict__ sin_t, int n_tokens, int heads, int half_dim,
                                   int half_layout) {
    const long long pair = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long total = (long long)n_tokens * heads * half_dim;
    if (pair >= total) return;
    const int i = (int)(pair % half_dim);          // which pair within the head
    const long long row = pair / half_dim;         // n * heads + head
    const long long n = row / heads;               // token
    const long long base = row * 2 * half_dim;     // start of this head's D values
    const long long ia = half_layout ? base + i : base + 2 * i;
    const long long ib = half_layout ? base + i + half_dim : base + 2 * i + 1;
    const float c = cos_t[n * half_dim + i], s = sin_t[n * half_dim + i];
    const float a = x[ia], b = x[ib];
    out[ia] = a * c - b * s;
    out[ib] = b * c + a * s;
}

// silu(x) = x * sigmoid(x), with sigmoid written through tanh as in minikv.model.silu,
// so that no exp() of a large |x| overflows.
__device__ __forceinline__ float silu_f(float x) {
    return x * (0.5f + 0.5f * tanhf(0.5f * x));
}

// ---------------------------------------------------------------------------
// silu_v1: out[i] = silu(x[i]) over n elements (out may alias x).
//
//   grid = (ceil(n / 256)), block = (256), one thread per element
//   bytes: reads 4*n, writes 4*n.
// ---------------------------------------------------------------------------
extern "C" __global__ void silu_v1(const float* x, float* out, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = silu_f(x[i]);
}

// ---------------------------------------------------------------------------
// swiglu_v1: the MLP's gate, fused: out[n, j] = silu(gate_up[n, j]) * gate_up[n, I + j].
//
//   gate_up: [N, 2I] float32 (the output of one matmul with [W_gate | W_up])
//   out:     [N, I]  float32
//   grid = (ceil(N*I / 256)), block = (256), one thread per output element
//   bytes: reads 8*N*I, writes 4*N*I (unfused: silu, then multiply, would
//          move 4*N*I more for the intermediate, twice).
// ---------------------------------------------------------------------------
// The (gate, up) pair of output element idx of a gated MLP over gate_up [N, 2I]; false past the end.
__device__ __forceinline__ bool gate_pair(const float* __restrict__ gate_up, long long idx, int n_tokens,
                                          int inter, float* g, float* u) {
    if (idx >= (long long)n_tokens * inter) return false;
    const long long n = idx / inter, j = idx % inter;
    *g = gate_up[n * 2 * inter + j];
    *u = gate_up[n * 2 * inter + inter + j];
    return true;
}

extern "C" __global__ void swiglu_v1(const float* __restrict__ gate_up, float* __restrict__ out, int n_tokens,
                                     int inter) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    float g, u;
    if (gate_pair(gate_up, idx, n_tokens, inter, &g, &u)) out[idx] = silu_f(g) * u;
}

// gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), as minikv.layers.gelu_tanh
// (Gemma's gelu_pytorch_tanh).
__device__ __forceinline__ float gelu_tanh_f(float x) {
    return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * (x * x * x))));
}

// ---------------------------------------------------------------------------
// geglu_v1: Gemma's MLP gate, fused as swiglu_v1: out[n, j] = gelu_tanh(gate_up[n, j]) * gate_up[n, I + j].
//
//   gate_up: [N, 2I] float32, out: [N, I] float32
//   grid = (ceil(N*I / 256)), block = (256), one thread per output element
//   bytes: reads 8*N*I, writes 4*N*I.
// ---------------------------------------------------------------------------
extern "C" __global__ void geglu_v1(const float* __restrict__ gate_up, float* __restrict__ out, int n_tokens,
                                    int inter) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    float g, u;
    if (gate_pair(gate_up, idx, n_tokens, inter, &g, &u)) out[idx] = gelu_tanh_f(g) * u;
}
