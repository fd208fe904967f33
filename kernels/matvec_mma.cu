// Products of 8 to 32 tokens a launch over Q4_0 and Q8_0 weights in the packed layout
// (matvec_packed.cu), on the int8 tensor cores: each block of 32 weights of 16 rows meets
// the same block of each tile of 8 tokens' 8-bit activations (xq [nt][cols], (scale,
// scale * sum) pairs xds [nt][cols / 32]) in one mma.m16n8k32, and the int32 result is
// scaled by the weights' and the activations' block scales. The dp4a kernels spend 8
// integer operations a weight byte on 8 tokens and run out of issue slots: on an H100 a
// llama3-8b Q4_0 step of 8 tokens takes 6.8 ms with them, 5.2 ms here, against 2.4 ms for
// one token; 16 and 32 tokens in one launch take 8.9 and 15.3 ms (each tile's loads of
// activations and scales and its scaling, not the weights' bytes, bound it).
//
// Q4_0 quants are stored + 8 (byte i holds element i in its low nibble and element i + 16
// in its high one); they enter the mma as unsigned bytes, and 8 * sum(x) is taken off after.
// Q8_0 quants are signed already.
//
// mma.m16n8k32 (s8): lane l, g = l / 4, t = l % 4. A (16 x 32, rows of weights): registers
// 0 and 2 hold elements 4t..4t+3 and 16+4t..16+4t+3 of row g, registers 1 and 3 the same of
// row g + 8. B (32 x 8, tokens): registers 0 and 1 hold elements 4t..4t+3 and 16+4t.. of
// token g. C: registers 0 and 1 are row g, tokens 2t and 2t + 1; 2 and 3 are row g + 8.
//
// Loads: the 4 lanes of a row group read a packed group (8 blocks) of a row in 16-byte
// loads, lane t the quants of blocks t and 4 + t, the group's 8 scales whole; a 4 x 4
// transpose through shuffles then gives lane t word t (and, for Q8_0, 4 + t) of every
// block, as the mma wants. 4-byte loads straight into that order (and 4 warps a block)
// decoded 8 tokens of llama3-8b Q4_0 at 1,217 t/s on an H100, this at 1,524.
//
// Launch: MQ_WARPS warps a block, gridDim.x = ceil(rows / 16): a block's warps take the same
// 16 rows and every MQ_WARPS-th group of 256 columns (so a 4096-row matrix still fills the
// GPU), each loading its next group while it multiplies the current one, and meet in
// shared memory at the end. Rows past `rows` repeat the last one and are never written.
// cols is a multiple of 256 (whole packed groups); rows and xq rows 16-byte aligned.
// Needs sm_80 (the host launches it only there).

#define MQ_WARPS 8
#define MQ_ROWS 16

__device__ __forceinline__ u32 word(const uint4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// Lane t of each 4-lane group holds v = words 0..3 of block t; returns o with o[j] = word t
// of block j (lane j's word t).
__device__ __forceinline__ void transpose4(const uint4& v, int t, u32 (&o)[4]) {
    o[0] = o[1] = o[2] = o[3] = word(v, t);
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int k = 1; k < 4; k++) {
        u32 got = __shfl_sync(0xffffffffu, word(v, (t - k) & 3), (lane & ~3) | ((t + k) & 3));
        int j = (t + k) & 3;
#pragma unroll
        for (int i = 0; i < 4; i++) o[i] = i == j ? got : o[i];
    }
}

// One packed group of one row as lane t loads it: the 8 scales, then the quants of blocks
// t and 4 + t (Q8_0: two 16-byte halves each).
template <bool Q8>
struct MqGroup {
    uint4 scales;
    uint4 q[2][Q8 ? 2 : 1];
};

template <bool Q8>
__device__ __forceinline__ void mq_load(const u8* row, int gi, int t, MqGroup<Q8>& out) {
    const int group = Q8 ? 272 : 144, qbytes = Q8 ? 32 : 16;
    const u8* gp = row + (size_t)gi * group;
    out.scales = ld_stream(gp);
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const u8* qs = gp + 16 + qbytes * (4 * h + t);
        out.q[h][0] = ld_stream(qs);
        if (Q8) out.q[h][Q8 ? 1 : 0] = ld_stream(qs + 16);
    }
}

__device__ __forceinline__ float half_of(const uint4& v, int j) {
    u32 w = word(v, j >> 1);
    return h2f((u16)((j & 1) ? (w >> 16) : (w & 0xffff)));
}

// Where tile j (tokens 8j..8j+7) of a launch's activations is, for lane (g, t): token
// 8j + g's row for the mma's B (none past nt) and the scales of the tokens 8j + 2t and
// 8j + 2t + 1 its C holds (rows past nt clamped; their results are never stored).
struct MqTile {
    const i8* x;
    const float2* ds0;
    const float2* ds1;
};

// c = a . (activation block b of the tile's tokens); a lane past the batch gives zeros.
template <bool UNSIGNED_A>
__device__ __forceinline__ void mq_mma(int (&c)[4], const u32 (&a)[4], const MqTile& tile, int b) {
    u32 x0 = 0, x1 = 0;
    if (tile.x) {
        const u32* xp = (const u32*)(tile.x + (size_t)b * 32);
        x0 = xp[0];
        x1 = xp[4];
    }
    mma_8bit<UNSIGNED_A>(c, a, x0, x1);
}

// Adds the group's 8 blocks of rows a (g) and b (g + 8) times every tile's tokens.
template <bool Q8, int NTILE>
__device__ __forceinline__ void mq_group(const MqGroup<Q8>& ga, const MqGroup<Q8>& gb, int gi,
                                         int t, const MqTile (&tiles)[NTILE],
                                         float (&acc)[NTILE][4]) {
#pragma unroll
    for (int h = 0; h < 2; h++) {
        // a_lo[j]: word t of block 4h + j of row a; Q8_0's a_hi[j]: word 4 + t.
        u32 a_lo[4], b_lo[4], a_hi[4], b_hi[4];
        transpose4(ga.q[h][0], t, a_lo);
        transpose4(gb.q[h][0], t, b_lo);
        if (Q8) {
            transpose4(ga.q[h][Q8 ? 1 : 0], t, a_hi);
            transpose4(gb.q[h][Q8 ? 1 : 0], t, b_hi);
        }
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int jb = 4 * h + j, b = gi * 8 + jb;
            u32 a[4];
            if (Q8) {
                a[0] = a_lo[j];
                a[1] = b_lo[j];
                a[2] = a_hi[j];
                a[3] = b_hi[j];
            } else {
                a[0] = a_lo[j] & 0x0F0F0F0Fu;
                a[1] = b_lo[j] & 0x0F0F0F0Fu;
                a[2] = (a_lo[j] >> 4) & 0x0F0F0F0Fu;
                a[3] = (b_lo[j] >> 4) & 0x0F0F0F0Fu;
            }
            float da = half_of(ga.scales, jb), db = half_of(gb.scales, jb);
#pragma unroll
            for (int k = 0; k < NTILE; k++) {
                int c[4];
                mq_mma<!Q8>(c, a, tiles[k], b);
                float2 s0 = tiles[k].ds0[b], s1 = tiles[k].ds1[b];
                // Q4_0's quants are stored + 8: take 8 * sum(x), which .y holds scaled, off.
                float p0 = s0.x * (float)c[0], p1 = s1.x * (float)c[1];
                float p2 = s0.x * (float)c[2], p3 = s1.x * (float)c[3];
                if (!Q8) {
                    p0 -= 8.f * s0.y;
                    p1 -= 8.f * s1.y;
                    p2 -= 8.f * s0.y;
                    p3 -= 8.f * s1.y;
                }
                acc[k][0] += da * p0;
                acc[k][1] += da * p1;
                acc[k][2] += db * p2;
                acc[k][3] += db * p3;
            }
        }
    }
}

// The tiles of lane (g, t) over nt rows of 8-bit activations (xq [nt][cols], xds [nt][cols
// / 32]), and their accumulators zeroed.
template <int NTILE>
__device__ __forceinline__ void mq_tiles(const i8* xq, const float2* xds, int cols, int nt,
                                         int g, int t, MqTile (&tiles)[NTILE],
                                         float (&acc)[NTILE][4]) {
    int nb = cols / 32;
#pragma unroll
    for (int k = 0; k < NTILE; k++) {
        int tok = 8 * k + g;
        tiles[k].x = tok < nt ? xq + (size_t)tok * cols + 4 * t : nullptr;
        tiles[k].ds0 = xds + (size_t)min(8 * k + 2 * t, nt - 1) * nb;
        tiles[k].ds1 = xds + (size_t)min(8 * k + 2 * t + 1, nt - 1) * nb;
        acc[k][0] = acc[k][1] = acc[k][2] = acc[k][3] = 0.f;
    }
}

template <bool Q8, int NTILE>
__device__ void mq_matvec(const u8* w, int rows, int cols, const i8* xq, const float2* xds,
                          int nt, float* out, int accum) {
    __shared__ float part[MQ_WARPS][NTILE * 4][32];
    pdl_trigger();
    const int group = Q8 ? 272 : 144;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    int base = blockIdx.x * MQ_ROWS;
    int ng = cols / 256;
    size_t row_bytes = (size_t)ng * group;
    const u8* wa = w + (size_t)min(base + g, rows - 1) * row_bytes;
    const u8* wb = w + (size_t)min(base + g + 8, rows - 1) * row_bytes;
    MqTile tiles[NTILE];
    float acc[NTILE][4];
    mq_tiles(xq, xds, cols, nt, g, t, tiles, acc);
    MqGroup<Q8> ca, cb, na, nb_;
    int gi = warp;
    // Weights are constant: the first group loads before the wait for the previous kernel.
    if (gi < ng) {
        mq_load<Q8>(wa, gi, t, ca);
        mq_load<Q8>(wb, gi, t, cb);
    }
    pdl_wait();
    for (; gi < ng; gi += MQ_WARPS) {
        int next = gi + MQ_WARPS;
        if (next < ng) {
            mq_load<Q8>(wa, next, t, na);
            mq_load<Q8>(wb, next, t, nb_);
        }
        mq_group<Q8, NTILE>(ca, cb, gi, t, tiles, acc);
        ca = na;
        cb = nb_;
    }
#pragma unroll
    for (int k = 0; k < NTILE; k++)
#pragma unroll
        for (int i = 0; i < 4; i++) part[warp][4 * k + i][lane] = acc[k][i];
    __syncthreads();
    // Every warp stores a share of the sums (the block's rows for some of the tiles).
#pragma unroll
    for (int k = 0; k < NTILE; k++) {
        if (k % MQ_WARPS != warp) continue;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float v = 0.f;
#pragma unroll
            for (int m = 0; m < MQ_WARPS; m++) v += part[m][4 * k + i][lane];
            int row = base + g + (i >= 2 ? 8 : 0), tok = 8 * k + 2 * t + (i & 1);
            if (row < rows && tok < nt) {
                float* o = out + (size_t)tok * rows + row;
                *o = accum ? *o + v : v;
            }
        }
    }
}

// Entries by the most tokens they take: 8, 16 or 32 (1, 2 or 4 tiles of 8).
#define MQ_ENTRY(ty, Q8, tokens)                                                              \
    extern "C" __global__ void __launch_bounds__(32 * MQ_WARPS) matvec_mma_##ty##_##tokens( \
        const u8* w, int rows, int cols, const i8* xq, const float2* xds, int n, float* out,  \
        int accum) {                                                                          \
        mq_matvec<Q8, tokens / 8>(w, rows, cols, xq, xds, n, out, accum);                     \
    }

MQ_ENTRY(q4_0, false, 8)
MQ_ENTRY(q4_0, false, 16)
MQ_ENTRY(q4_0, false, 32)
MQ_ENTRY(q8_0, true, 8)
MQ_ENTRY(q8_0, true, 16)
MQ_ENTRY(q8_0, true, 32)

// ---- Mixture-of-experts prefill products over Q4_K experts on the int8 tensor cores ----
// A Q4_K sub-block (32 values, one scale and min) is one k32 step. Lane (g, t) loads, of
// rows g and g + 8, the words at bytes 4t and 16 + 4t of each 32-byte run of qs (values of
// sub-blocks 2G in the low nibbles, 2G + 1 in the high ones): masked or shifted, they are
// A's registers in mq_group's order, with no transpose. The int32 result is scaled by each
// row's d * scale and the activations' block scale, and dmin * min times the activations'
// scaled sum is taken off. Work items are common.cuh's (moe_item): one expert's rows times
// up to MKQ_TILES * 8 rows of gathered 8-bit inputs.
// Launch: MKQ_WARPS warps a block, gridDim = (ceil(rows / 16), items); the warps take every
// MKQ_WARPS-th block of 256 columns and meet in shared memory. cols a multiple of 256, the
// experts' rows 16-byte aligned. Needs sm_80 (the host launches it only there).
#define MKQ_WARPS 4
#define MKQ_TILES 4

// Adds block blk of rows ra (g) and rb (g + 8) times every tile's tokens (tiles with no
// token, 8k >= nt, are skipped).
__device__ __forceinline__ void mkq_block(const u8* ra, const u8* rb, int blk, int t, int nt,
                                          const MqTile (&tiles)[MKQ_TILES],
                                          float (&acc)[MKQ_TILES][4]) {
    const u8* ba = ra + (size_t)blk * 144;
    const u8* bb = rb + (size_t)blk * 144;
    u32 wa[8], wb[8];
#pragma unroll
    for (int G = 0; G < 4; G++) {
        wa[2 * G] = *(const u32*)(ba + 16 + 32 * G + 4 * t);
        wa[2 * G + 1] = *(const u32*)(ba + 32 + 32 * G + 4 * t);
        wb[2 * G] = *(const u32*)(bb + 16 + 32 * G + 4 * t);
        wb[2 * G + 1] = *(const u32*)(bb + 32 + 32 * G + 4 * t);
    }
    float da = h2f(ld16(ba)), ma = h2f(ld16(ba + 2));
    float db = h2f(ld16(bb)), mb = h2f(ld16(bb + 2));
    const u32 m4 = 0x0F0F0F0Fu;
#pragma unroll
    for (int s = 0; s < 8; s++) {
        int G = s >> 1, sh = 4 * (s & 1);
        u32 a[4] = {(wa[2 * G] >> sh) & m4, (wb[2 * G] >> sh) & m4, (wa[2 * G + 1] >> sh) & m4,
                    (wb[2 * G + 1] >> sh) & m4};
        int sca, mna, scb, mnb;
        scale_min_k4(s, ba + 4, &sca, &mna);
        scale_min_k4(s, bb + 4, &scb, &mnb);
        float fa = da * (float)sca, fb = db * (float)scb;
        float oa = ma * (float)mna, ob = mb * (float)mnb;
        int b = blk * 8 + s;
#pragma unroll
        for (int k = 0; k < MKQ_TILES; k++) {
            if (8 * k >= nt) break;
            int c[4];
            mq_mma<true>(c, a, tiles[k], b);
            float2 s0 = tiles[k].ds0[b], s1 = tiles[k].ds1[b];
            acc[k][0] += fa * s0.x * (float)c[0] - oa * s0.y;
            acc[k][1] += fa * s1.x * (float)c[1] - oa * s1.y;
            acc[k][2] += fb * s0.x * (float)c[2] - ob * s0.y;
            acc[k][3] += fb * s1.x * (float)c[3] - ob * s1.y;
        }
    }
}

// This warp's share of rows base .. base + 16 of w (rows past `rows` repeat the last one)
// times the nt rows of xq/xds, into part[warp] (acc element i of tile k at [4k + i][lane]).
__device__ __forceinline__ void mkq_rows(const u8* w, int rows, int base, int cols,
                                         const i8* xq, const float2* xds, int nt,
                                         float (*part)[MKQ_TILES * 4][32]) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    int nblk = cols / 256;
    size_t row_bytes = (size_t)nblk * 144;
    const u8* ra = w + (size_t)min(base + g, rows - 1) * row_bytes;
    const u8* rb = w + (size_t)min(base + g + 8, rows - 1) * row_bytes;
    MqTile tiles[MKQ_TILES];
    float acc[MKQ_TILES][4];
    mq_tiles(xq, xds, cols, nt, g, t, tiles, acc);
    for (int blk = warp; blk < nblk; blk += MKQ_WARPS) mkq_block(ra, rb, blk, t, nt, tiles, acc);
#pragma unroll
    for (int k = 0; k < MKQ_TILES; k++)
#pragma unroll
        for (int i = 0; i < 4; i++) part[warp][4 * k + i][lane] = acc[k][i];
}

// Sum over the warps of value i of tile k (after __syncthreads), and its (row, token).
__device__ __forceinline__ float mkq_sum(float (*part)[MKQ_TILES * 4][32], int k, int i,
                                         int base, int* row, int* tok) {
    int lane = threadIdx.x & 31;
    float v = 0.f;
#pragma unroll
    for (int m = 0; m < MKQ_WARPS; m++) v += part[m][4 * k + i][lane];
    *row = base + (lane >> 2) + (i >= 2 ? 8 : 0);
    *tok = 8 * k + 2 * (lane & 3) + (i & 1);
    return v;
}

// act[row + j][r] = silu(gate_x[r] . x[row + j]) * (up_x[r] . x[row + j]) for each item's
// rows j; the arguments of common.cuh's moe_swiglu (aq and ads unused: the host
// quantizes act for down in a pass of its own).
extern "C" __global__ void __launch_bounds__(32 * MKQ_WARPS)
    moemma_swiglu_q4_k_32(const u8* wg, const u8* wu, u64 expert_bytes, const u32* ids,
                          const u32* tiles, int n_expert, int k, int ff, int cols, const i8* xq,
                          const float2* xds, float* act, i8* aq, float2* ads) {
    __shared__ float pg[MKQ_WARPS][MKQ_TILES * 4][32];
    __shared__ float pu[MKQ_WARPS][MKQ_TILES * 4][32];
    PDL_ENTRY();
    MoeItem it;
    if (!moe_item(ids, tiles, n_expert, k, &it)) return;
    int warp = threadIdx.x >> 5, base = blockIdx.x * MQ_ROWS;
    size_t w = (size_t)it.expert * expert_bytes, x = (size_t)it.token_row * cols;
    mkq_rows(wg + w, ff, base, cols, xq + x, xds + x / 32, it.n, pg);
    mkq_rows(wu + w, ff, base, cols, xq + x, xds + x / 32, it.n, pu);
    __syncthreads();
    for (int t = warp; t < MKQ_TILES; t += MKQ_WARPS) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int row, tok;
            float g = mkq_sum(pg, t, i, base, &row, &tok);
            float u = mkq_sum(pu, t, i, base, &row, &tok);
            if (row < ff && tok < it.n) act[(size_t)(it.row + tok) * ff + row] = gate_act(g, GATE_SILU) * u;
        }
    }
}

// out[row + j][r] = down_x[r] . act[row + j] for each item's rows j (8-bit act aq/ads);
// the arguments of common.cuh's moe_down.
extern "C" __global__ void __launch_bounds__(32 * MKQ_WARPS)
    moemma_down_q4_k_32(const u8* wd, u64 expert_bytes, const u32* ids, const u32* tiles,
                        int n_expert, int k, int e, int ff, const i8* aq, const float2* ads,
                        float* out) {
    __shared__ float part[MKQ_WARPS][MKQ_TILES * 4][32];
    PDL_ENTRY();
    MoeItem it;
    if (!moe_item(ids, tiles, n_expert, k, &it)) return;
    int warp = threadIdx.x >> 5, base = blockIdx.x * MQ_ROWS;
    size_t a = (size_t)it.row * ff;
    mkq_rows(wd + (size_t)it.expert * expert_bytes, e, base, ff, aq + a, ads + a / 32, it.n,
             part);
    __syncthreads();
    for (int t = warp; t < MKQ_TILES; t += MKQ_WARPS) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int row, tok;
            float v = mkq_sum(part, t, i, base, &row, &tok);
            if (row < e && tok < it.n) out[(size_t)(it.row + tok) * e + row] = v;
        }
    }
}
