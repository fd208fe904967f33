// Flash attention on the tensor cores for prefill batches: scores and values are products
// of f16 tiles on mma.sync m16n8k16 with f32 accumulation, and a running (online) softmax
// per query row keeps the scores of one tile of cells at a time, so the work per query
// grows with its span but nothing is written back except the output.
//
// A block takes the query heads that share one KV head (grouped-query attention) for a
// few tokens: its FA_ROWS rows are (token, head) pairs, token-major, so each K/V tile read
// into shared memory serves every head of the group. Rows past the group's heads or the
// batch's tokens are padding: masked everywhere and never written.

#define FA_WARPS 4
#define FA_THREADS (FA_WARPS * 32)
#define FA_ROWS (FA_WARPS * 16)  // query rows of a block: 16 per warp, one mma row tile
#define FA_CELLS 64              // cells of one K/V tile
#define FA_LOG2E 1.4426950408889634f

// Row stride of every shared tile in halves: 8 more than the head, so the 8 rows one
// ldmatrix reads start 16 bytes apart and fall into different bank groups.
template <int D> struct FaTile {
    static constexpr int STRIDE = D + 8;
    static constexpr int HALVES = FA_CELLS * STRIDE;  // one K or V tile
    static constexpr int Q_HALVES = FA_ROWS * STRIDE;  // the query tile
};

// Two floats as the f16 pair of one 32-bit fragment register, lo in the low half.
__device__ __forceinline__ u32 pack_h2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// Copies (TY_F16) or dequantizes (TY_Q8_0, TY_Q4_0) the FA_CELLS cache rows of KV head kh
// from cell c0 into the shared tile dst ([FA_CELLS][STRIDE] f16). Cells at or past `hi`
// read cell `lo` (a real cell of the block's union) and are masked by the caller. Cells are
// virtual (see kv_cell).
// F16 rows go through cp.async (the caller commits and waits); quantized rows are decoded
// by plain loads, one 32-value block per thread and step.
template <int D, int TY>
__device__ __forceinline__ void fa_load_tile(u16* dst, const u8* cache, int n_kv_heads, int kh,
                                             u32 c0, u32 lo, u32 hi, u32 ring,
                                             const u32* blocks) {
    constexpr int STRIDE = FaTile<D>::STRIDE;
    if (TY == TY_F16) {
        constexpr int CHUNKS = D / 8;  // 16-byte pieces of a row
#pragma unroll
        for (int i = threadIdx.x; i < FA_CELLS * CHUNKS; i += FA_THREADS) {
            int row = i / CHUNKS, ch = i % CHUNKS;
            u32 cell = kv_cell(c0 + row < hi ? c0 + row : lo, ring, blocks);
            const u16* src = (const u16*)cache + ((u64)cell * n_kv_heads + kh) * D + ch * 8;
            cp_async16(smem_addr(dst + row * STRIDE + ch * 8), src, 16);
        }
    } else {
        constexpr int BLOCKS = D / 32;  // quant blocks of a row
        constexpr int BB = TY == TY_Q8_0 ? 34 : 18;
#pragma unroll
        for (int i = threadIdx.x; i < FA_CELLS * BLOCKS; i += FA_THREADS) {
            int row = i / BLOCKS, b = i % BLOCKS;
            u32 cell = kv_cell(c0 + row < hi ? c0 + row : lo, ring, blocks);
            const u8* blk = cache + ((u64)cell * n_kv_heads + kh) * (BLOCKS * BB) + b * BB;
            float d = h2f(ld16(blk));
            u32* out = (u32*)(dst + row * STRIDE + b * 32);
            if (TY == TY_Q8_0) {
#pragma unroll
                for (int j = 0; j < 16; j++) {
                    // Blocks are 34 bytes: quants are only 2-byte aligned.
                    u16 w = ld16(blk + 2 + 2 * j);
                    out[j] = pack_h2(d * (float)(i8)(w & 255), d * (float)(i8)(w >> 8));
                }
            } else {
                // Element j is the low nibble of byte j, element j + 16 its high nibble; one
                // 2-byte load holds the bytes of elements 2j and 2j + 1.
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    u16 w = ld16(blk + 2 + 2 * j);
                    int b0 = w & 255, b1 = w >> 8;
                    out[j] = pack_h2(d * (float)((b0 & 15) - 8), d * (float)((b1 & 15) - 8));
                    out[8 + j] = pack_h2(d * (float)((b0 >> 4) - 8), d * (float)((b1 >> 4) - 8));
                }
            }
        }
    }
}

// out[t][h] = softmax over the cells of spans[t] (pairs first_cell, n_cells of virtual cells:
// in a ring when ring > 0, through the block table `blocks` when not null, see kv_cell) of
// cap_score(scale * q[t][h] . k[cell][kh], softcap), applied to v[cell][kh], for the heads
// h of KV head kh = h / (n_heads / n_kv_heads); cache rows [n_kv_heads][D] of TY (F16,
// Q8_0, Q4_0). A token with no cells gets zeros. q and out are f32 [n_tokens][n_heads][D];
// q is scaled and rounded to f16, the probabilities too, before their products.
// With gridDim.z = n_splits > 1 each block takes an equal share (whole tiles) of its
// union of cells and writes (o[D] unnormalized, max, sum) of each row to
// partial[t][h][split] for attention_merge (attention.cu) instead of out.
// Launch: grid (n_kv_heads * head_blocks, ceil(n_tokens / tokens_per_block), n_splits), FA_THREADS
// threads, dynamic shared memory (FA_ROWS + 4 * FA_CELLS) * (D + 8) * 2 bytes (Q, two K
// and two V tiles), where hb = min(n_heads / n_kv_heads, FA_ROWS) heads of a group share a block,
// head_blocks = ceil(group / hb), tokens_per_block = FA_ROWS / hb. D is a multiple of 16;
// cache rows are 16-byte aligned (F16) or 2-byte aligned (quantized).
// The block walks the union of its tokens' spans tile by tile; F16 tiles are fetched with
// cp.async one tile ahead of the products.
template <int D, int TY>
__device__ __forceinline__ void flash_attention(const float* __restrict__ q,
                                                const u8* __restrict__ k,
                                                const u8* __restrict__ v,
                                                const u32* __restrict__ spans, u32 ring,
                                                const u32* __restrict__ blocks,
                                                int n_tokens,
                                                int n_heads, int n_kv_heads, float scale,
                                                float softcap, float* __restrict__ out,
                                                float* __restrict__ partial) {
    constexpr int STRIDE = FaTile<D>::STRIDE;
    constexpr int TILE = FaTile<D>::HALVES;
    constexpr int KSTEPS = D / 16;   // k-steps of the score product
    constexpr int DTILES = D / 8;    // n-tiles of the value product
    constexpr int CTILES = FA_CELLS / 8;
    constexpr bool ASYNC = TY == TY_F16;
    extern __shared__ __align__(16) u16 fa_smem[];
    u16* qs = fa_smem;
    u16* ks = fa_smem + FaTile<D>::Q_HALVES;  // two tiles
    u16* vs = ks + 2 * TILE;                  // two tiles

    int group = n_heads / n_kv_heads;
    int hb = min(group, FA_ROWS);
    int head_blocks = (group + hb - 1) / hb;
    int tokens_per_block = FA_ROWS / hb;
    int kh = blockIdx.x / head_blocks;
    int h0 = kh * group + (blockIdx.x % head_blocks) * hb;  // first head of the block
    int h_end = (kh + 1) * group;
    int t0 = blockIdx.y * tokens_per_block;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

    // The block's cells: the union of its tokens' spans, or with splits this block's share
    // of it (whole tiles, in order).
    u32 lo = 0xffffffffu, hi = 0;
    for (int i = 0; i < tokens_per_block && t0 + i < n_tokens; i++) {
        u32 f = spans[2 * (t0 + i)], n = spans[2 * (t0 + i) + 1];
        if (n > 0) {
            lo = min(lo, f);
            hi = max(hi, f + n);
        }
    }
    if (gridDim.z > 1 && lo < hi) {
        u32 tiles = (hi - lo + FA_CELLS - 1) / FA_CELLS;
        u32 share = (tiles + gridDim.z - 1) / gridDim.z * FA_CELLS;
        u32 from = lo + min(blockIdx.z * share, hi - lo);
        hi = from + min(share, hi - from);
        lo = from;
    }

    // Scaled queries as f16, padding rows zero. Without soft-capping the scores come out
    // of the product in base 2 already (log2(e) in the query's scale): one multiply less
    // per score.
    const bool capped = softcap > 0.f;
    const float qscale = capped ? scale : scale * FA_LOG2E;
    for (int i = threadIdx.x; i < FA_ROWS * (D / 4); i += FA_THREADS) {
        int r = i / (D / 4), c = (i % (D / 4)) * 4;
        int t = t0 + r / hb, h = h0 + r % hb;
        float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
        if (r < tokens_per_block * hb && t < n_tokens && h < h_end)
            x = *(const float4*)(q + ((u64)t * n_heads + h) * D + c);
        u32* d = (u32*)(qs + r * STRIDE + c);
        d[0] = pack_h2(x.x * qscale, x.y * qscale);
        d[1] = pack_h2(x.z * qscale, x.w * qscale);
    }

    // This thread's two rows of the warp's 16: g and g + 8.
    int g = lane >> 2, quad = lane & 3;
    u32 first[2], end[2];
    bool live[2];
#pragma unroll
    for (int ri = 0; ri < 2; ri++) {
        int r = warp * 16 + g + 8 * ri;
        int t = t0 + r / hb, h = h0 + r % hb;
        live[ri] = r < tokens_per_block * hb && t < n_tokens && h < h_end;
        first[ri] = live[ri] ? spans[2 * t] : 0;
        end[ri] = live[ri] ? first[ri] + spans[2 * t + 1] : 0;
    }
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
    float o[DTILES][4];
#pragma unroll
    for (int j = 0; j < DTILES; j++) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;

    // Heads up to 128 keep the warp's query fragments in registers for the whole walk;
    // larger ones (whose output accumulators already take 128 registers) reread them from
    // shared memory at each tile.
    constexpr bool Q_REGS = D <= 128;
    u32 qf[Q_REGS ? KSTEPS : 1][4];
    if constexpr (Q_REGS) {
        __syncthreads();  // the queries are in shared memory
#pragma unroll
        for (int kk = 0; kk < KSTEPS; kk++)
            ldmatrix_x4(smem_addr(qs + (warp * 16 + (lane & 15)) * STRIDE + kk * 16 + (lane >> 4) * 8), qf[kk]);
    }

    if (ASYNC && lo < hi) {
        fa_load_tile<D, TY>(ks, k, n_kv_heads, kh, lo, lo, hi, ring, blocks);
        fa_load_tile<D, TY>(vs, v, n_kv_heads, kh, lo, lo, hi, ring, blocks);
        cp_async_commit();
    }
    int buf = 0;
    for (u32 c0 = lo; c0 < hi; c0 += FA_CELLS, buf ^= 1) {
        u16* kt = ks + buf * TILE;
        u16* vt = vs + buf * TILE;
        if (ASYNC) {
            bool next = c0 + FA_CELLS < hi;
            if (next) {
                // The other buffers were last read in the previous step, which every warp
                // has left (the barrier at its end).
                u32 c1 = c0 + FA_CELLS;
                fa_load_tile<D, TY>(ks + (buf ^ 1) * TILE, k, n_kv_heads, kh, c1, lo, hi, ring, blocks);
                fa_load_tile<D, TY>(vs + (buf ^ 1) * TILE, v, n_kv_heads, kh, c1, lo, hi, ring, blocks);
                cp_async_commit();
                cp_async_wait<1>();
            } else {
                cp_async_wait<0>();
            }
        } else {
            fa_load_tile<D, TY>(kt, k, n_kv_heads, kh, c0, lo, hi, ring, blocks);
            fa_load_tile<D, TY>(vt, v, n_kv_heads, kh, c0, lo, hi, ring, blocks);
        }
        // The tile (and, the first time, the queries) is in shared memory for every warp.
        __syncthreads();

        // Scores: this warp's 16 rows against the tile's FA_CELLS cells.
        float s[CTILES][4];
#pragma unroll
        for (int j = 0; j < CTILES; j++) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < KSTEPS; kk++) {
            u32 a[4];
            if constexpr (Q_REGS) {
#pragma unroll
                for (int i = 0; i < 4; i++) a[i] = qf[kk][i];
            } else {
                ldmatrix_x4(smem_addr(qs + (warp * 16 + (lane & 15)) * STRIDE + kk * 16 + (lane >> 4) * 8), a);
            }
#pragma unroll
            for (int j = 0; j < CTILES; j += 2) {
                // Cells 8j..8j+15: b0, b1 of n-tile j, then of n-tile j + 1.
                u32 b[4];
                int cell = 8 * j + (lane & 7) + ((lane >> 4) << 3);
                ldmatrix_x4(smem_addr(kt + cell * STRIDE + kk * 16 + ((lane >> 3) & 1) * 8), b);
                mma_16816(s[j], a, b[0], b[1]);
                mma_16816(s[j + 1], a, b[2], b[3]);
            }
        }

        // Soft-cap, mask, and the running softmax (in base 2) of each of the two rows. A
        // tile inside both rows' spans (all but the last of a causal prompt chunk) needs
        // no mask.
        float mt[2] = {NEG_INF, NEG_INF};
        bool inside = c0 >= first[0] && c0 >= first[1] && c0 + FA_CELLS <= end[0] &&
                      c0 + FA_CELLS <= end[1];
        if (capped) {
#pragma unroll
            for (int j = 0; j < CTILES; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) s[j][e] = cap_score(s[j][e], softcap) * FA_LOG2E;
        }
        if (inside) {
#pragma unroll
            for (int j = 0; j < CTILES; j++) {
#pragma unroll
                for (int e = 0; e < 4; e++) mt[e >> 1] = fmaxf(mt[e >> 1], s[j][e]);
            }
        } else {
#pragma unroll
            for (int j = 0; j < CTILES; j++) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    int ri = e >> 1;
                    u32 cell = c0 + 8 * j + 2 * quad + (e & 1);
                    float x = cell >= first[ri] && cell < end[ri] ? s[j][e] : NEG_INF;
                    s[j][e] = x;
                    mt[ri] = fmaxf(mt[ri], x);
                }
            }
        }
        float corr[2];
#pragma unroll
        for (int ri = 0; ri < 2; ri++) {
            mt[ri] = fmaxf(mt[ri], __shfl_xor_sync(0xffffffffu, mt[ri], 1));
            mt[ri] = fmaxf(mt[ri], __shfl_xor_sync(0xffffffffu, mt[ri], 2));
            float mn = fmaxf(m[ri], mt[ri]);
            // No cell of this row so far: nothing to add (and no inf - inf).
            corr[ri] = mn == NEG_INF ? 1.f : exp2f(m[ri] - mn);
            m[ri] = mn;
            l[ri] *= corr[ri];
        }
#pragma unroll
        for (int j = 0; j < CTILES; j++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int ri = e >> 1;
                float p = m[ri] == NEG_INF ? 0.f : exp2f(s[j][e] - m[ri]);
                s[j][e] = p;
                l[ri] += p;
            }
        }
#pragma unroll
        for (int j = 0; j < DTILES; j++) {
            o[j][0] *= corr[0];
            o[j][1] *= corr[0];
            o[j][2] *= corr[1];
            o[j][3] *= corr[1];
        }

        // Values: the probabilities (the score accumulators of two n-tiles make the A
        // fragment of one k-step) times the tile's value rows.
#pragma unroll
        for (int kc = 0; kc < FA_CELLS / 16; kc++) {
            u32 a[4];
            a[0] = pack_h2(s[2 * kc][0], s[2 * kc][1]);
            a[1] = pack_h2(s[2 * kc][2], s[2 * kc][3]);
            a[2] = pack_h2(s[2 * kc + 1][0], s[2 * kc + 1][1]);
            a[3] = pack_h2(s[2 * kc + 1][2], s[2 * kc + 1][3]);
#pragma unroll
            for (int j = 0; j < DTILES; j += 2) {
                // Head columns 8j..8j+15 of cells 16kc..16kc+15, transposed into b0, b1 of
                // n-tile j, then of n-tile j + 1.
                u32 b[4];
                int cell = 16 * kc + (lane & 7) + (((lane >> 3) & 1) << 3);
                ldmatrix_x4_trans(smem_addr(vt + cell * STRIDE + 8 * j + (lane >> 4) * 8), b);
                mma_16816(o[j], a, b[0], b[1]);
                mma_16816(o[j + 1], a, b[2], b[3]);
            }
        }
        // Every warp is done with this tile before it is refilled.
        __syncthreads();
    }

#pragma unroll
    for (int ri = 0; ri < 2; ri++) {
        l[ri] += __shfl_xor_sync(0xffffffffu, l[ri], 1);
        l[ri] += __shfl_xor_sync(0xffffffffu, l[ri], 2);
        if (!live[ri]) continue;
        int r = warp * 16 + g + 8 * ri;
        int t = t0 + r / hb, h = h0 + r % hb;
        u64 th = (u64)t * n_heads + h;
        if (gridDim.z > 1) {
            // Unnormalized, with the running max in natural-log units, for attention_merge.
            float* ph = partial + (th * gridDim.z + blockIdx.z) * (D + 2);
#pragma unroll
            for (int j = 0; j < DTILES; j++)
                *(float2*)(ph + 8 * j + 2 * quad) = make_float2(o[j][2 * ri], o[j][2 * ri + 1]);
            if (quad == 0) {
                ph[D] = m[ri] * (1.f / FA_LOG2E);
                ph[D + 1] = l[ri];
            }
            continue;
        }
        float inv = l[ri] > 0.f ? 1.f / l[ri] : 0.f;
        float* dst = out + th * D + 2 * quad;
#pragma unroll
        for (int j = 0; j < DTILES; j++)
            *(float2*)(dst + 8 * j) = make_float2(o[j][2 * ri] * inv, o[j][2 * ri + 1] * inv);
    }
}

#define FA_ENTRY(d, ty, TY)                                                                   \
    extern "C" __global__ void __launch_bounds__(FA_THREADS)                                  \
        flash_attention_##d##_##ty(const float* q, const u8* k, const u8* v, const u32* spans, \
                                   u32 ring, const u32* blocks, int n_tokens, int n_heads,     \
                                   int n_kv_heads, float scale, float softcap, float* out,     \
                                   float* partial) {                                           \
        PDL_ENTRY();                                                                          \
        flash_attention<d, TY>(q, k, v, spans, ring, blocks, n_tokens, n_heads, n_kv_heads,   \
                               scale, softcap, out, partial);                                 \
    }
#define FA_TYPES(d)              \
    FA_ENTRY(d, f16, TY_F16)     \
    FA_ENTRY(d, q8_0, TY_Q8_0)   \
    FA_ENTRY(d, q4_0, TY_Q4_0)

FA_TYPES(64)
FA_TYPES(96)
FA_TYPES(128)
FA_TYPES(256)
