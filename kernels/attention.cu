// KV cache writes and causal grouped-query attention over the cache.

// cache row cells[t] = f16(src[t]). Launch: any 1-D grid over n_tokens * kv_dim elements.
extern "C" __global__ void kv_store_f16(const float* src, int kv_dim, const u32* cells,
                                        int n_tokens, u16* cache) {
    PDL_ENTRY();
    u64 total = (u64)n_tokens * kv_dim;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        u64 t = i / kv_dim, c = i % kv_dim;
        cache[(u64)cells[t] * kv_dim + c] = f2h(src[i]);
    }
}

// Q8_0 (d = max|x| / 127, q = round(x / d)) and Q4_0 (d = max / -8, q = x / d + 8.5
// truncated, clamped to 0..15), as tether-gguf's quantizers. One thread per 32-block.
// Launch: any 1-D grid over n_tokens * kv_dim / 32 blocks; kv_dim is a multiple of 32.
extern "C" __global__ void kv_store_quant(const float* src, int kv_dim, const u32* cells,
                                          int n_tokens, u8* cache, int ty) {
    PDL_ENTRY();
    int nb = kv_dim / 32;
    int bb = ty == TY_Q8_0 ? 34 : 18;
    u64 total = (u64)n_tokens * nb;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        u64 t = i / nb;
        int b = (int)(i % nb);
        const float* x = src + t * kv_dim + b * 32;
        u8* dst = cache + (u64)cells[t] * nb * bb + (u64)b * bb;
        float amax = 0.f, vmax = 0.f;
        for (int j = 0; j < 32; j++) {
            float a = fabsf(x[j]);
            if (amax < a) { amax = a; vmax = x[j]; }
        }
        if (ty == TY_Q8_0) {
            float d = amax / 127.f;
            float id = d != 0.f ? 1.f / d : 0.f;
            u32 dh = f2h(d);
            dst[0] = (u8)(dh & 255u); dst[1] = (u8)(dh >> 8);
            for (int j = 0; j < 32; j++) {
                float q = fminf(fmaxf(roundf(x[j] * id), -128.f), 127.f);
                dst[2 + j] = (u8)(i8)(int)q;
            }
        } else {
            float d = vmax / -8.f;
            float id = d != 0.f ? 1.f / d : 0.f;
            u32 dh = f2h(d);
            dst[0] = (u8)(dh & 255u); dst[1] = (u8)(dh >> 8);
            for (int j = 0; j < 16; j++) {
                int q0 = min(15, max(0, (int)fminf(fmaxf(x[j] * id + 8.5f, -128.f), 127.f)));
                int q1 = min(15, max(0, (int)fminf(fmaxf(x[j + 16] * id + 8.5f, -128.f), 127.f)));
                dst[2 + j] = (u8)(q0 | (q1 << 4));
            }
        }
    }
}

#define ATT_WARPS 4
#define ATT_THREADS 128
#define ATT_MAX_PER_LANE 8  // head_dim <= 256
#define ATT_CPW 4           // cells a warp scores at once (independent loads in flight)

__device__ __forceinline__ float cache_at(int ty, const u8* row, int d) {
    return ty == TY_F16 ? h2f(((const u16*)row)[d]) : dequant_at(ty, row, d);
}

// Max (is_max) or sum of v over the block; `red` is ATT_WARPS floats of shared memory.
__device__ float block_reduce(float v, bool is_max, float* red) {
    v = is_max ? warp_max(v) : warp_sum(v);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float r = red[0];
    for (int w = 1; w < ATT_WARPS; w++) r = is_max ? fmaxf(r, red[w]) : r + red[w];
    return r;
}

// Attention of query row t, head h over split z of the cells of spans[t] (equal shares of
// at most chunk cells)
// (pairs first_cell, n_cells of virtual cells: in a ring of `ring` cells per sequence when
// ring > 0, else through the block table `blocks` when it is not null; see kv_cell);
// kh = h / (n_heads / n_kv_heads). Cache rows are [n_kv_heads][head_dim] of ty (F16, Q8_0,
// Q4_0), head_bytes per head.
// Launch: gridDim = (n_heads, n_tokens, n_splits), blockDim.x = 128, dynamic shared memory
// 4 * chunk bytes, head_dim <= 256.
// Scores are scale * q . k, soft-capped by cap_score when softcap > 0 (Gemma 2).
// Three passes over the block's cells: scores (a warp per cell, lanes over the head),
// softmax in shared memory, then values (a thread per element of the head, so each cell's
// value row is one coalesced read). With one split the block writes out[t][h]; with several
// it writes (o[head_dim], max, sum) to partial[t][h][z] for attention_merge.
extern "C" __global__ void __launch_bounds__(ATT_THREADS)
    attention(const float* q, const u8* k, const u8* v, int ty, const u32* spans, u32 ring,
              const u32* blocks, int n_heads, int n_kv_heads, int head_dim, u64 head_bytes,
              float scale, float softcap, u32 chunk, float* out, float* partial) {
    PDL_ENTRY();
    extern __shared__ float scores[];
    __shared__ float red[ATT_WARPS];
    int h = blockIdx.x, t = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int kh = h / (n_heads / n_kv_heads);
    const float* qh = q + ((u64)t * n_heads + h) * head_dim;
    u32 first = spans[2 * t], n_cells = spans[2 * t + 1];
    // Each split takes an equal share of this token's cells; `chunk` (the shared memory
    // per block) bounds the share, so one launch shape serves every length up to
    // gridDim.z * chunk and a recorded decode step stays valid as the context grows.
    u32 share = min((n_cells + gridDim.z - 1) / gridDim.z, chunk);
    u32 c0 = blockIdx.z * share;
    int nc = c0 < n_cells ? (int)min(share, n_cells - c0) : 0;
    u64 cell_bytes = (u64)n_kv_heads * head_bytes;
    const u8* kbase = k + (u64)kh * head_bytes;
    const u8* vbase = v + (u64)kh * head_bytes;
    u32 v0 = first + c0;  // the block's first virtual cell (see kv_cell)
    float qr[ATT_MAX_PER_LANE];
#pragma unroll
    for (int j = 0; j < ATT_MAX_PER_LANE; j++) {
        int d = lane + 32 * j;
        qr[j] = d < head_dim ? qh[d] * scale : 0.f;
    }
    for (int c = warp * ATT_CPW; c < nc; c += ATT_WARPS * ATT_CPW) {
        float s[ATT_CPW];
#pragma unroll
        for (int i = 0; i < ATT_CPW; i++) {
            s[i] = 0.f;
            u32 cell = kv_cell(v0 + min(c + i, nc - 1), ring, blocks);
            const u8* kr = kbase + (u64)cell * cell_bytes;
#pragma unroll
            for (int j = 0; j < ATT_MAX_PER_LANE; j++) {
                int d = lane + 32 * j;
                if (d < head_dim) s[i] += qr[j] * cache_at(ty, kr, d);
            }
        }
#pragma unroll
        for (int i = 0; i < ATT_CPW; i++) {
            float r = warp_sum(s[i]);
            if (lane == 0 && c + i < nc) scores[c + i] = cap_score(r, softcap);
        }
    }
    __syncthreads();
    float mx = NEG_INF;
    for (int c = threadIdx.x; c < nc; c += ATT_THREADS) mx = fmaxf(mx, scores[c]);
    mx = block_reduce(mx, true, red);
    float sum = 0.f;
    for (int c = threadIdx.x; c < nc; c += ATT_THREADS) {
        float p = expf(scores[c] - mx);
        scores[c] = p;
        sum += p;
    }
    sum = block_reduce(sum, false, red);  // its barriers also publish the probabilities
    u64 th = (u64)t * n_heads + h;
    float inv = sum > 0.f ? 1.f / sum : 0.f;
    float* ph = partial + (th * gridDim.z + blockIdx.z) * (head_dim + 2);
    for (int d = threadIdx.x; d < head_dim; d += ATT_THREADS) {
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        int c = 0;
        for (; c + 4 <= nc; c += 4) {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                u64 at = (u64)kv_cell(v0 + c + i, ring, blocks) * cell_bytes;
                acc[i] += scores[c + i] * cache_at(ty, vbase + at, d);
            }
        }
        for (; c < nc; c++) {
            u64 at = (u64)kv_cell(v0 + c, ring, blocks) * cell_bytes;
            acc[0] += scores[c] * cache_at(ty, vbase + at, d);
        }
        float o = (acc[0] + acc[1]) + (acc[2] + acc[3]);
        if (gridDim.z == 1) out[th * head_dim + d] = o * inv;
        else ph[d] = o;
    }
    if (gridDim.z > 1 && threadIdx.x == 0) {
        ph[head_dim] = mx;
        ph[head_dim + 1] = sum;
    }
}

// The same attention for an F16 cache with head_dim / 8 = G a power of two <= 32 (heads of
// 8..256): a group of G threads takes one cell, each thread 8 elements (one 16-byte load),
// so a block keeps 128 / G cells times 4 in flight in both passes. Launch as `attention`.
extern "C" __global__ void __launch_bounds__(ATT_THREADS)
    attention_f16v(const float* q, const u8* k, const u8* v, int ty, const u32* spans, u32 ring,
                   const u32* blocks, int n_heads, int n_kv_heads, int head_dim,
                   u64 head_bytes, float scale, float softcap, u32 chunk, float* out,
                   float* partial) {
    PDL_ENTRY();
    extern __shared__ float scores[];
    __shared__ float red[ATT_WARPS];
    __shared__ float osum[ATT_THREADS * 8];
    int h = blockIdx.x, t = blockIdx.y;
    int G = head_dim >> 3, groups = ATT_THREADS / G;
    int gi = threadIdx.x / G, gl = threadIdx.x % G;
    int kh = h / (n_heads / n_kv_heads);
    const float* qh = q + ((u64)t * n_heads + h) * head_dim + 8 * gl;
    u32 first = spans[2 * t], n_cells = spans[2 * t + 1];
    // Each split takes an equal share of this token's cells; `chunk` (the shared memory
    // per block) bounds the share, so one launch shape serves every length up to
    // gridDim.z * chunk and a recorded decode step stays valid as the context grows.
    u32 share = min((n_cells + gridDim.z - 1) / gridDim.z, chunk);
    u32 c0 = blockIdx.z * share;
    int nc = c0 < n_cells ? (int)min(share, n_cells - c0) : 0;
    u64 cell_bytes = (u64)n_kv_heads * head_bytes;
    u64 off = (u64)kh * head_bytes + 16 * gl;
    const u8* kbase = k + off;
    const u8* vbase = v + off;
    u32 v0 = first + c0;  // the block's first virtual cell (see kv_cell)
    float qr[8];
#pragma unroll
    for (int e = 0; e < 8; e++) qr[e] = qh[e] * scale;
    int step = groups * 4;
    for (int base = 0; base < nc; base += step) {
        uint4 kv[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int c = min(base + i * groups + gi, nc - 1);
            kv[i] = *(const uint4*)(kbase + (u64)kv_cell(v0 + c, ring, blocks) * cell_bytes);
        }
#pragma unroll
        for (int i = 0; i < 4; i++) {
            u32 w[4] = {kv[i].x, kv[i].y, kv[i].z, kv[i].w};
            float s = 0.f;
#pragma unroll
            for (int e = 0; e < 4; e++)
                s += qr[2 * e] * h2f((u16)(w[e] & 0xffff)) + qr[2 * e + 1] * h2f((u16)(w[e] >> 16));
            for (int o = G >> 1; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
            int c = base + i * groups + gi;
            if (gl == 0 && c < nc) scores[c] = cap_score(s, softcap);
        }
    }
    __syncthreads();
    float mx = NEG_INF;
    for (int c = threadIdx.x; c < nc; c += ATT_THREADS) mx = fmaxf(mx, scores[c]);
    mx = block_reduce(mx, true, red);
    float sum = 0.f;
    for (int c = threadIdx.x; c < nc; c += ATT_THREADS) {
        float p = expf(scores[c] - mx);
        scores[c] = p;
        sum += p;
    }
    sum = block_reduce(sum, false, red);  // its barriers also publish the probabilities
    float o[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int base = 0; base < nc; base += step) {
        uint4 vv[4];
        float p[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int c = base + i * groups + gi;
            p[i] = c < nc ? scores[c] : 0.f;
            u32 cell = kv_cell(v0 + min(c, nc - 1), ring, blocks);
            vv[i] = *(const uint4*)(vbase + (u64)cell * cell_bytes);
        }
#pragma unroll
        for (int i = 0; i < 4; i++) {
            u32 w[4] = {vv[i].x, vv[i].y, vv[i].z, vv[i].w};
#pragma unroll
            for (int e = 0; e < 4; e++) {
                o[2 * e] += p[i] * h2f((u16)(w[e] & 0xffff));
                o[2 * e + 1] += p[i] * h2f((u16)(w[e] >> 16));
            }
        }
    }
#pragma unroll
    for (int e = 0; e < 8; e++) osum[gi * head_dim + 8 * gl + e] = o[e];
    __syncthreads();
    u64 th = (u64)t * n_heads + h;
    float inv = sum > 0.f ? 1.f / sum : 0.f;
    float* ph = partial + (th * gridDim.z + blockIdx.z) * (head_dim + 2);
    for (int d = threadIdx.x; d < head_dim; d += ATT_THREADS) {
        float acc = 0.f;
        for (int g = 0; g < groups; g++) acc += osum[g * head_dim + d];
        if (gridDim.z == 1) out[th * head_dim + d] = acc * inv;
        else ph[d] = acc;
    }
    if (gridDim.z > 1 && threadIdx.x == 0) {
        ph[head_dim] = mx;
        ph[head_dim + 1] = sum;
    }
}

// Merges the n_splits partial results of attention into out[t][h]; with Q8 it also writes
// the merged rows as 8-bit blocks (xq [n_tokens][n_heads * head_dim], xds per 32 values)
// for the output projection's decode kernel, saving it a quantize pass. Q8 needs head_dim
// % 32 == 0, so each warp's 32 values of an iteration are one whole block.
template <bool Q8>
__device__ __forceinline__ void merge_splits(const float* partial, int n_splits, int n_heads,
                                             int head_dim, float* out, i8* xq, float2* xds) {
    u64 th = (u64)blockIdx.y * n_heads + blockIdx.x;
    const float* p = partial + th * n_splits * (head_dim + 2);
    float mx = NEG_INF;
    for (int z = 0; z < n_splits; z++) {
        const float* ps = p + (u64)z * (head_dim + 2);
        if (ps[head_dim + 1] > 0.f) mx = fmaxf(mx, ps[head_dim]);
    }
    float total = 0.f;
    for (int z = 0; z < n_splits; z++) {
        const float* ps = p + (u64)z * (head_dim + 2);
        if (ps[head_dim + 1] > 0.f) total += ps[head_dim + 1] * expf(ps[head_dim] - mx);
    }
    float inv = total > 0.f ? 1.f / total : 0.f;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float acc = 0.f;
        for (int z = 0; z < n_splits; z++) {
            const float* ps = p + (u64)z * (head_dim + 2);
            if (ps[head_dim + 1] > 0.f) acc += ps[d] * expf(ps[head_dim] - mx);
        }
        u64 at = th * head_dim + d;
        out[at] = acc * inv;
        if (Q8) q8_block(acc * inv, threadIdx.x & 31, xq + at, xds + at / 32);
    }
}

// Launch: gridDim = (n_heads, n_tokens), blockDim.x = 128.
extern "C" __global__ void __launch_bounds__(128)
    attention_merge(const float* partial, int n_splits, int n_heads, int head_dim, float* out) {
    PDL_ENTRY();
    merge_splits<false>(partial, n_splits, n_heads, head_dim, out, nullptr, nullptr);
}

// attention_merge that also writes the 8-bit copy; launch as attention_merge.
extern "C" __global__ void __launch_bounds__(128)
    attention_merge_q8(const float* partial, int n_splits, int n_heads, int head_dim,
                       float* out, i8* xq, float2* xds) {
    PDL_ENTRY();
    merge_splits<true>(partial, n_splits, n_heads, head_dim, out, xq, xds);
}
