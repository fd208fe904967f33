// Mixture-of-experts prefill on gemm.cu's tile kernel (this file is compiled after gemm.cu,
// in one module): the picks sorted by expert (moe.cu's moe_group) are gathered as f16 rows,
// and each work item (one expert, up to BN of its rows: common.cuh's moe_item) is one
// column of tile blocks, whose weight tiles the experts' quantized blocks decode into. An
// expert's weights are read once per item, 32 or 64 of its picks, where the 8-bit item
// kernels (matvec_mma.cu's moemma_*) read them once per 32 and its activations once per
// 16 weight rows from global memory.

// Row row_of[p] of out ([rows][cols] f16) = pick p's token row x[p / k] ([nt][cols] f32),
// for every pick with a row. Grid-stride over groups of 8 values; cols a multiple of 8 and
// x 16-byte aligned.
extern "C" __global__ void moe_gather_f16(const float* __restrict__ x, const int* row_of,
                                          int picks, int k, int cols, u16* __restrict__ out) {
    PDL_ENTRY();
    int groups = cols / 8;
    u64 total = (u64)picks * groups;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < total;
         i += (u64)gridDim.x * blockDim.x) {
        int p = (int)(i / groups), c0 = (int)(i % groups) * 8;
        int row = row_of[p];
        if (row < 0) continue;
        const float* src = x + (u64)(p / k) * cols + c0;
        float4 lo = *(const float4*)src, hi = *(const float4*)(src + 4);
        float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
        store8_f16(out + (u64)row * cols + c0, v);
    }
}

// act[row + n][bm + m] = silu(gate_x[bm + m] . x[token_row + n]) * (up_x[bm + m] . x[...]) (f32
// [rows][ff]) for the item's n < its rows and bm + m < ff. The block's 128 weight rows are
// 64 of gate (threads 0-63) and the same 64 of up (64-127), so the warps holding up's sums
// hand them over through shared memory and the gate warps write the product. x16 is the
// gathered f16 inputs [rows][cols]. Launch: grid (ceil(ff / 64), items), 128 threads.
template <int TY, int BN>
__device__ __forceinline__ void moeg_swiglu(const u8* wg, const u8* wu, u64 expert_bytes,
                                            u64 row_bytes, const u32* tiles, int n_expert,
                                            int ff, int cols, const u16* x16, float* act) {
    constexpr int NI = BN / 2 / 8;
    // The up sums: 64 rows of BN tokens, rows padded by 4 floats against bank conflicts.
    constexpr int LD = BN + 4;
    static_assert(64 * LD * 4 <= sizeof(u16) * GEMM_STAGES * GEMM_M * GEMM_K,
                  "the up sums fit the weight stages");
    __shared__ __align__(128) u16 sa[GEMM_STAGES][GEMM_M * GEMM_K];
    __shared__ __align__(128) u16 sb[GEMM_STAGES][BN * GEMM_K];
    PDL_ENTRY();
    MoeItem it;
    if (!moe_item(nullptr, tiles, n_expert, 1, &it)) return;
    int bm = blockIdx.x * 64, t = threadIdx.x;
    const u8* w = (t < 64 ? wg : wu) + (u64)it.expert * expert_bytes;
    float acc[4][NI][4];
    gemm_tile<2, TY, BN>(sa, sb, w, row_bytes, bm + (t & 63), x16 + (u64)it.token_row * cols, 0,
                         0, ff, it.n, cols, 0, cols / GEMM_K, acc);
    __syncthreads();
    float* up = (float*)&sa[0][0];
    int warp = t >> 5, lane = t & 31, gid = lane >> 2, tq = lane & 3;
    int wn = (warp >> 1) * (BN / 2);
    bool gate = (warp & 1) == 0;
#pragma unroll
    for (int mi = 0; mi < 4; mi++)
#pragma unroll
        for (int ni = 0; ni < NI; ni++)
#pragma unroll
            for (int c = 0; c < 4; c++) {
                int m = mi * 16 + gid + (c >= 2 ? 8 : 0), n = wn + ni * 8 + tq * 2 + (c & 1);
                if (!gate) up[m * LD + n] = acc[mi][ni][c];
            }
    __syncthreads();
    if (!gate) return;
#pragma unroll
    for (int mi = 0; mi < 4; mi++)
#pragma unroll
        for (int ni = 0; ni < NI; ni++)
#pragma unroll
            for (int c = 0; c < 4; c++) {
                int m = mi * 16 + gid + (c >= 2 ? 8 : 0), n = wn + ni * 8 + tq * 2 + (c & 1);
                if (bm + m < ff && n < it.n) {
                    float v = gate_act(acc[mi][ni][c], GATE_SILU) * up[m * LD + n];
                    act[(u64)(it.row + n) * ff + bm + m] = v;
                }
            }
}

// Row r of act16 ([rows][ff] f16) = row r of act (f32) / scale[r], scale[r] being the power
// of two that brings the row's largest magnitude to at most 2^15 (1 when it is there
// already): a product of two sums overflows f16 (65,504) far more easily than either, and
// down's sums are scaled back. Launch: one block of MOE_ACT_THREADS a row.
#define MOE_ACT_THREADS 256
extern "C" __global__ void __launch_bounds__(MOE_ACT_THREADS)
    moe_act_f16(const float* __restrict__ act, int ff, u16* __restrict__ act16, float* scale) {
    PDL_ENTRY();
    __shared__ float warp_max[MOE_ACT_THREADS / 32];
    const float* row = act + (u64)blockIdx.x * ff;
    float m = 0.f;
    for (int c = threadIdx.x; c < ff; c += MOE_ACT_THREADS) m = fmaxf(m, fabsf(row[c]));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
    __syncthreads();
    m = 0.f;
#pragma unroll
    for (int w = 0; w < MOE_ACT_THREADS / 32; w++) m = fmaxf(m, warp_max[w]);
    float s = m > 32768.f ? exp2f(ceilf(log2f(m / 32768.f))) : 1.f;
    float inv = 1.f / s;
    for (int c = threadIdx.x; c < ff; c += MOE_ACT_THREADS) {
        act16[(u64)blockIdx.x * ff + c] = f2h(row[c] * inv);
    }
    if (threadIdx.x == 0) scale[blockIdx.x] = s;
}

// out[row + n][bm + m] = (down_x[bm + m] . act16[row + n]) * scale[row + n] (f32 [rows][e]) for
// the item's n and bm + m < e; act16 and scale as moe_act_f16 writes them. Launch: grid
// (ceil(e / 128), items), 128 threads.
template <int TY, int BN>
__device__ __forceinline__ void moeg_down(const u8* wd, u64 expert_bytes, u64 row_bytes,
                                          const u32* tiles, int n_expert, int e, int ff,
                                          const u16* act, const float* scale, float* out) {
    __shared__ __align__(128) u16 sa[GEMM_STAGES][GEMM_M * GEMM_K];
    __shared__ __align__(128) u16 sb[GEMM_STAGES][BN * GEMM_K];
    PDL_ENTRY();
    MoeItem it;
    if (!moe_item(nullptr, tiles, n_expert, 1, &it)) return;
    int bm = blockIdx.x * GEMM_M;
    float acc[4][BN / 2 / 8][4];
    gemm_tile<2, TY, BN>(sa, sb, wd + (u64)it.expert * expert_bytes, row_bytes,
                         bm + (int)threadIdx.x, act + (u64)it.row * ff, 0, 0, e, it.n, ff, 0,
                         ff / GEMM_K, acc);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int wm = (warp & 1) * 64, wn = (warp >> 1) * (BN / 2), gid = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int ni = 0; ni < BN / 2 / 8; ni++)
#pragma unroll
        for (int j = 0; j < 2; j++) {
            int n = wn + ni * 8 + tq * 2 + j;
            if (n >= it.n) continue;
            float s = scale[it.row + n];
            float* o = out + (u64)(it.row + n) * e + bm + wm;
#pragma unroll
            for (int mi = 0; mi < 4; mi++)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    int m = mi * 16 + gid + 8 * h;
                    if (bm + wm + m < e) o[m] = acc[mi][ni][2 * h + j] * s;
                }
        }
}

// moeg_swiglu_<name>_n<bn> and moeg_down_<name>_n<bn> for the weight type ty (QTile's).
#define MOEG_ENTRY(name, ty, bn)                                                                 \
    extern "C" __global__ void __launch_bounds__(128, GEMM_NARROW_BLOCKS)                       \
        moeg_swiglu_##name##_n##bn(const u8* wg, const u8* wu, u64 expert_bytes, u64 row_bytes, \
                                   const u32* tiles, int n_expert, int ff, int cols,            \
                                   const u16* x16, float* act) {                                \
        moeg_swiglu<ty, bn>(wg, wu, expert_bytes, row_bytes, tiles, n_expert, ff, cols, x16,   \
                            act);                                                               \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(128, GEMM_NARROW_BLOCKS)                       \
        moeg_down_##name##_n##bn(const u8* wd, u64 expert_bytes, u64 row_bytes,                 \
                                 const u32* tiles, int n_expert, int e, int ff,                 \
                                 const u16* act, const float* scale, float* out) {              \
        moeg_down<ty, bn>(wd, expert_bytes, row_bytes, tiles, n_expert, e, ff, act, scale, out); \
    }
#define MOEG_ENTRIES(name, ty) MOEG_ENTRY(name, ty, 32) MOEG_ENTRY(name, ty, 64)

MOEG_ENTRIES(q4_0p, TY_Q4_0P)
MOEG_ENTRIES(q8_0p, TY_Q8_0P)
MOEG_ENTRIES(q4_k, TY_Q4_K)
MOEG_ENTRIES(q5_k, TY_Q5_K)
MOEG_ENTRIES(q6_kp, TY_Q6_KP)
MOEG_ENTRIES(q6_k, TY_Q6_K)
MOEG_ENTRIES(iq4_xsp, TY_IQ4_XSP)
