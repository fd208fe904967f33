// Normalisation, activation, residual and rotary kernels on f32 rows.

// 1 / sqrt(mean(xr^2) + eps) of one row, summed by the whole block in f64 (as on the cpu:
// rows reach 8192+). Every thread of the block must call it.
__device__ float row_inv_rms(const float* xr, int dim, float eps) {
    __shared__ double part[32];
    double ss = 0.0;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += (double)xr[i] * (double)xr[i];
    ss = warp_sum_d(ss);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
    __syncthreads();
    double total = 0.0;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) total += part[w];
    return (float)(1.0 / sqrt(total / (double)dim + (double)eps));
}

// out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * weight. Launch: gridDim.x = n_tokens,
// blockDim.x = a multiple of 32 up to 1024 (decode rows are one block each, so the block is
// wide: its loads are what the whole op waits for).
extern "C" __global__ void __launch_bounds__(1024)
    rms_norm(const float* x, const float* weight, int dim, float eps, float* out) {
    PDL_ENTRY();
    const float* xr = x + (size_t)blockIdx.x * dim;
    float* o = out + (size_t)blockIdx.x * dim;
    float inv = row_inv_rms(xr, dim, eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) o[i] = xr[i] * inv * weight[i];
}

// Float4s of a row each thread of rms_norm_q8 holds in registers: rows of up to
// 1024 * 4 * NORM_VEC = 16384 values.
#define NORM_VEC 4

// rms_norm that also writes its rows quantized to 8-bit blocks for the decode product
// kernels (values xq [n_tokens][dim], scales xds [n_tokens][dim / 32]), saving them a pass.
// Decode runs it twice a layer on one row, so it is built for latency: x and the weights
// are read once, together, into registers; the sum of squares is f32 (a few ulps from
// the cpu's f64, far inside the 8-bit rounding that follows). Eight lanes hold a 32-value
// block. Launch: gridDim.x = n_tokens, blockDim.x a multiple of 32 with
// dim <= 16 * blockDim.x; dim % 32 == 0.
extern "C" __global__ void __launch_bounds__(1024)
    rms_norm_q8(const float* x, const float* weight, int dim, float eps, float* out, i8* xq,
                float2* xds) {
    PDL_ENTRY();
    __shared__ float part[32];
    __shared__ float inv_s;
    int n4 = dim >> 2, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    size_t row = (size_t)blockIdx.x * dim;
    const float4* xr = (const float4*)(x + row);
    const float4* w4 = (const float4*)weight;
    float4 v[NORM_VEC], w[NORM_VEC];
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < NORM_VEC; k++) {
        int i = threadIdx.x + k * blockDim.x;
        v[k] = make_float4(0.f, 0.f, 0.f, 0.f);
        w[k] = v[k];
        if (i < n4) {
            v[k] = xr[i];
            w[k] = w4[i];
        }
        ss += v[k].x * v[k].x + v[k].y * v[k].y + v[k].z * v[k].z + v[k].w * v[k].w;
    }
    ss = warp_sum(ss);
    if (lane == 0) part[warp] = ss;
    __syncthreads();
    if (warp == 0) {
        float t = lane < (int)(blockDim.x >> 5) ? part[lane] : 0.f;
        t = warp_sum(t);
        if (lane == 0) inv_s = rsqrtf(t / (float)dim + eps);
    }
    __syncthreads();
    float inv = inv_s;
    float4* o4 = (float4*)(out + row);
#pragma unroll
    for (int k = 0; k < NORM_VEC; k++) {
        int i = threadIdx.x + k * blockDim.x;
        if (k * (int)blockDim.x >= n4) break;  // the same for the whole block
        float4 r = make_float4(v[k].x * inv * w[k].x, v[k].y * inv * w[k].y,
                               v[k].z * inv * w[k].z, v[k].w * inv * w[k].w);
        float amax = fmaxf(fmaxf(fabsf(r.x), fabsf(r.y)), fmaxf(fabsf(r.z), fabsf(r.w)));
#pragma unroll
        for (int o = 4; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        float d = amax / 127.0f;
        float id = d > 0.f ? 1.0f / d : 0.f;
        int q[4];
        float rv[4] = {r.x, r.y, r.z, r.w};
        int sum = 0;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            q[j] = q8_round(rv[j], id);
            sum += q[j];
        }
#pragma unroll
        for (int o = 4; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        if (i < n4) {
            o4[i] = r;
            *(u32*)(xq + row + 4 * (size_t)i) =
                (u32)(q[0] & 0xff) | (u32)(q[1] & 0xff) << 8 | (u32)(q[2] & 0xff) << 16 |
                (u32)(q[3] & 0xff) << 24;
            if ((lane & 7) == 0) xds[(row + 4 * (size_t)i) / 32] = make_float2(d, d * (float)sum);
        }
    }
}

// out[i] = silu(gate[i]) * up[i]. Launch: any 1-D grid (grid-stride loop).
extern "C" __global__ void swiglu(const float* gate, const float* up, u64 n, float* out) {
    PDL_ENTRY();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        float g = gate[i];
        out[i] = g / (1.f + expf(-g)) * up[i];
    }
}

// out[i] = gelu_tanh(gate[i]) * up[i] (common.cuh). Launch: any 1-D grid (grid-stride loop).
extern "C" __global__ void geglu(const float* gate, const float* up, u64 n, float* out) {
    PDL_ENTRY();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        out[i] = gelu_tanh(gate[i]) * up[i];
}

// x[i] *= factor. Launch: any 1-D grid.
extern "C" __global__ void scale(float* x, u64 n, float factor) {
    PDL_ENTRY();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        x[i] *= factor;
}

// x[i] = cap * tanh(x[i] / cap), cap > 0 (checked by the caller). Launch: any 1-D grid.
extern "C" __global__ void softcap(float* x, u64 n, float cap) {
    PDL_ENTRY();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        x[i] = cap * tanhf(x[i] / cap);
}

// x[i] += y[i]. Launch: any 1-D grid.
extern "C" __global__ void add(float* x, const float* y, u64 n) {
    PDL_ENTRY();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        x[i] += y[i];
}

// x[i] += bias[i % dim] for i < n. Launch: any 1-D grid.
extern "C" __global__ void add_bias(float* x, const float* bias, u64 n, u64 dim) {
    PDL_ENTRY();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        x[i] += bias[i % dim];
}

// cos and sin of pair i's angle at position pos, times mscale (crate::rope::pair_angle):
// base^(-2i/n_rot) turned pos times, divided by its llama3 factor (factors may be null),
// times freq_scale; with YaRN (yarn_high >= 0) blended with the unscaled angle over the ramp
// [yarn_low, yarn_high] of pair indices, and mscale applied (1 otherwise). Angles in f64 as
// on the cpu.
__device__ __forceinline__ void rope_cos_sin(int i, int n_rot, u32 pos, float freq_base,
                                             float freq_scale, const float* factors,
                                             float yarn_low, float yarn_high, float mscale,
                                             float* c, float* s) {
    double freq = pow((double)freq_base, -2.0 * (double)i / (double)n_rot);
    double factor = factors ? (double)factors[i] : 1.0;
    double extrapolated = (double)pos * freq / factor;
    double theta = extrapolated * (double)freq_scale;
    double m = 1.0;
    if (yarn_high >= 0.f) {
        double y = ((double)i - (double)yarn_low) / fmax(0.001, (double)(yarn_high - yarn_low));
        double keep = 1.0 - fmin(fmax(y, 0.0), 1.0);
        theta = theta * (1.0 - keep) + extrapolated * keep;
        m = (double)mscale;
    }
    *c = (float)(cos(theta) * m);
    *s = (float)(sin(theta) * m);
}

// Rotates pair i of each head of each token by its angle at positions[t] (rope_cos_sin).
// Launch: any 1-D grid over n_tokens * n_heads * (n_rot / 2) pairs.
extern "C" __global__ void rope(float* x, int n_tokens, int n_heads, int head_dim,
                                const u32* positions, int n_rot, float freq_base,
                                float freq_scale, int neox, const float* factors,
                                float yarn_low, float yarn_high, float mscale) {
    PDL_ENTRY();
    int half = n_rot / 2;
    u64 total = (u64)n_tokens * n_heads * half;
    for (u64 idx = blockIdx.x * (u64)blockDim.x + threadIdx.x; idx < total;
         idx += (u64)gridDim.x * blockDim.x) {
        int i = (int)(idx % half);
        u64 th = idx / half;
        int t = (int)(th / n_heads);
        float* head = x + th * head_dim;
        float c, s;
        rope_cos_sin(i, n_rot, positions[t], freq_base, freq_scale, factors, yarn_low,
                     yarn_high, mscale, &c, &s);
        int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
        float x0 = head[a], x1 = head[b];
        head[a] = x0 * c - x1 * s;
        head[b] = x0 * s + x1 * c;
    }
}

// One decode step's rotary embedding and KV write for an f16 cache: rotates the query
// heads and key heads of each token in place (as `rope`), then writes the rotated keys and
// the values into cache row cells[t] (as kv_store_f16), in one launch instead of four.
// Launch: gridDim = (n_heads + n_kv_heads, n_tokens), any blockDim.x.
extern "C" __global__ void rope_store_f16(float* q, float* k, const float* v, int n_heads,
                                          int n_kv_heads, int head_dim, const u32* positions,
                                          int n_rot, float freq_base, float freq_scale,
                                          int neox, const float* factors, float yarn_low,
                                          float yarn_high, float mscale, const u32* cells,
                                          u16* kc, u16* vc) {
    PDL_ENTRY();
    int h = blockIdx.x, t = blockIdx.y;
    bool is_q = h < n_heads;
    int kh = h - n_heads;
    float* head = is_q ? q + ((u64)t * n_heads + h) * head_dim
                       : k + ((u64)t * n_kv_heads + kh) * head_dim;
    int half = n_rot / 2;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float c, s;
        rope_cos_sin(i, n_rot, positions[t], freq_base, freq_scale, factors, yarn_low,
                     yarn_high, mscale, &c, &s);
        int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
        float x0 = head[a], x1 = head[b];
        head[a] = x0 * c - x1 * s;
        head[b] = x0 * s + x1 * c;
    }
    if (is_q) return;
    __syncthreads();
    u64 kv_dim = (u64)n_kv_heads * head_dim;
    u64 row = (u64)cells[t] * kv_dim + (u64)kh * head_dim;
    const float* vh = v + (u64)t * kv_dim + (u64)kh * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        kc[row + d] = f2h(head[d]);
        vc[row + d] = f2h(vh[d]);
    }
}

// dst[0..bytes) = src[0..bytes), src being pinned host memory mapped into the device's
// address space. Recorded decode steps copy their inputs with this kernel rather than a copy
// node: the driver takes the host far longer to launch a graph that holds copy nodes.
// src and dst are 16-byte aligned. Launch: any grid of 256-thread blocks.
extern "C" __global__ void copy_in(const uint4* src, uint4* dst, u64 bytes) {
    PDL_ENTRY();
    const u64 at = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    const u64 words = bytes / 16;
    for (u64 i = at; i < words; i += stride) dst[i] = src[i];
    const u64 tail = words * 16 + at;
    if (tail < bytes) ((u8*)dst)[tail] = ((const u8*)src)[tail];
}

// out[t] = dequant(table row ids[t]). Launch: gridDim.x = n_ids, blockDim.x = 256.
extern "C" __global__ void get_rows(const u8* table, int ty, u64 row_bytes, int row_len,
                                    const u32* ids, float* out) {
    PDL_ENTRY();
    const u8* row = table + (u64)ids[blockIdx.x] * row_bytes;
    float* o = out + (u64)blockIdx.x * row_len;
    for (int e = threadIdx.x; e < row_len; e += blockDim.x) o[e] = dequant_at(ty, row, e);
}

// out[r] = the index of the largest non-NaN value of row r of x (n values) in IEEE total
// order (+0 above -0, +inf above all), the lowest index among equals; 0 for a row of NaN.
// Each value becomes a 64-bit key, its order-preserving bits above its inverted index, so
// one unsigned max finds both. Launch: gridDim.x = rows, blockDim.x = 1024.
extern "C" __global__ void __launch_bounds__(1024) argmax_rows(const float* x, u64 n, u32* out) {
    PDL_ENTRY();
    const float* row = x + (u64)blockIdx.x * n;
    // 0 is no key of a non-NaN value: -inf's is 0x007fffff above the index bits.
    u64 best = 0;
    for (u64 i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = row[i];
        if (v != v) continue;
        const u32 b = __float_as_uint(v);
        const u32 order = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
        const u64 key = ((u64)order << 32) | (u64)(~(u32)i);
        best = key > best ? key : best;
    }
    for (int o = 16; o > 0; o >>= 1) {
        const u64 other = __shfl_xor_sync(0xffffffffu, best, o);
        best = other > best ? other : best;
    }
    __shared__ u64 warps[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) warps[warp] = best;
    __syncthreads();
    if (warp != 0) return;
    best = lane < (int)(blockDim.x >> 5) ? warps[lane] : 0;
    for (int o = 16; o > 0; o >>= 1) {
        const u64 other = __shfl_xor_sync(0xffffffffu, best, o);
        best = other > best ? other : best;
    }
    if (lane == 0) out[blockIdx.x] = best == 0 ? 0u : ~(u32)best;
}
