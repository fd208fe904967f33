// Products of 17 to a few dozen tokens over quantized weights on the tensor cores, read
// straight from their blocks: no f16 copy of the weight is made in memory. The tokens come
// as f16 scaled per token by a power of two into [-1, 1] (xh [nt][cols] and the scales
// xs [nt], as mmq_tokens_f16 writes them): a token of any range converts without
// overflow, and the sums are scaled back when they are written.
//
// A block computes MMQ_ROWS weight rows x MMQ_TOKENS tokens; each of its 4 warps takes 16
// rows against every token. A warp reads its rows' quants (with their scales, and for Q4_K
// / Q5_K the mins) from global memory straight into registers, a set of MMQ_HG groups of 32
// columns ahead of the one it multiplies, and turns them there into the f16 A fragments of
// mma m16n8k16 (a byte permute, a subtraction and a multiply-add per two values), which add
// into f32 accumulators: every weight byte is read once per token tile, never goes through
// shared memory, and no per-group scaling of the sums is left. The tokens, which all four
// warps read, are staged in shared memory MMQ_K columns at a time. A tile whose batch ends in
// its first half multiplies only that half. The values are those of the f16 GEMM path (f16
// weights and tokens, f32 sums).
//
// Launch: blockDim.x = MMQ_THREADS, grid (ceil(nt / MMQ_TOKENS), ceil(rows / MMQ_ROWS),
// splits); split z takes chunks [z * k_chunks, (z + 1) * k_chunks) of MMQ_K columns and
// writes its partial sums at dst + z * split_stride, element (t, r) at t * ldd + r
// (gemm_reduce adds them); with one split that is the result, added to what dst holds
// when `accumulate`. cols is a multiple of 32 (of 256 for K-quants and packed rows), xh
// rows 16-byte aligned. Rows and tokens past the ends read as zero and are never written.
// Needs sm_80 (the host launches it only there).

#define MMQ_ROWS 64
#define MMQ_TOKENS 64
#define MMQ_K 256
#define MMQ_THREADS 128
// Shared-memory row pitch of the tokens, in halves: 544 bytes puts the 8 rows one fragment
// load touches on different banks.
#define MMQ_LDH (MMQ_K + 16)

// mma m16n8k16 with f16 inputs, accumulating into c; not volatile so that the compiler
// may interleave it with the loads.
__device__ __forceinline__ void mmq_mma(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                        u32 b1) {
#if __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

// Groups of 32 columns whose weights one warp holds in registers at a time, and loads one
// such set ahead (2, 4 and 8 groups measured within 5% on an H100).
#define MMQ_HG (MMQ_K / 64)
#define MMQ_NH (MMQ_K / 32 / MMQ_HG)

// One half chunk of a warp's 16 rows, as mma A fragments: for each group of 32 columns,
// this thread's quants of rows g and g + 8 at columns 4t.. and 16 + 4t.. (signed bytes),
// the rows' scales (two a group for Q6_K, whose scales cover 16 values) and mins.
struct MmqFrag {
    u32 q[MMQ_HG][4];
    float s[MMQ_HG][2][2];
    float m[MMQ_HG][2];
};

template <int TY>
__device__ __forceinline__ void mmq_frag_load(MmqFrag& f, const u8* wa, const u8* wb, int k0,
                                              int cols, int tig) {
    constexpr int SUB = mmq_sub<TY>();
#pragma unroll
    for (int g = 0; g < MMQ_HG; g++) {
        const int k = k0 + 32 * g;
        if (k < cols) {
            f.q[g][0] = mmq_word<TY>(wa, k + 4 * tig);
            f.q[g][1] = mmq_word<TY>(wb, k + 4 * tig);
            f.q[g][2] = mmq_word<TY>(wa, k + 16 + 4 * tig);
            f.q[g][3] = mmq_word<TY>(wb, k + 16 + 4 * tig);
            float unused;
            mmq_scale<TY>(wa, k / SUB, &f.s[g][0][0], &f.m[g][0]);
            mmq_scale<TY>(wb, k / SUB, &f.s[g][1][0], &f.m[g][1]);
            if (SUB == 16) {
                mmq_scale<TY>(wa, k / SUB + 1, &f.s[g][0][1], &unused);
                mmq_scale<TY>(wb, k / SUB + 1, &f.s[g][1][1], &unused);
            } else {
                f.s[g][0][1] = f.s[g][1][1] = 0.0f;
            }
        } else {
            f.q[g][0] = f.q[g][1] = f.q[g][2] = f.q[g][3] = 0u;
            f.s[g][0][0] = f.s[g][0][1] = f.s[g][1][0] = f.s[g][1][1] = 0.0f;
            f.m[g][0] = f.m[g][1] = 0.0f;
        }
    }
}

// Each warp takes 16 of the block's rows against all of its tokens. Its weights go from
// global memory straight into registers, a set of groups ahead of their use, and become
// f16 mma fragments there: every weight byte is read once per token tile and never goes
// through shared memory. The tokens (f16), which all four warps read, are staged in shared
// memory a chunk at a time, each 4 values stored as (0, 2, 1, 3) so that one 8-byte load
// is a thread's two B registers.
template <int TY, int NI>
__device__ __forceinline__ void mmq_block(const u8* __restrict__ w, u64 row_bytes, int rows,
                                          int cols, const u16* __restrict__ xh,
                                          const float* __restrict__ xs, int nt,
                                          int k_chunks, float* __restrict__ dst, int ldd,
                                          u64 split_stride, int accumulate) {
    constexpr int SUB = mmq_sub<TY>();
    constexpr bool MIN = mmq_has_min<TY>();
    __shared__ __align__(16) u16 sx[MMQ_TOKENS * MMQ_LDH];

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int gid = lane >> 2, tig = lane & 3;
    const int t0 = blockIdx.x * MMQ_TOKENS;
    const int ra = blockIdx.y * MMQ_ROWS + warp * 16 + gid;
    // Rows past the end read the last row; their sums are never written.
    const u8* wa = w + (u64)min(ra, rows - 1) * row_bytes;
    const u8* wb = w + (u64)min(ra + 8, rows - 1) * row_bytes;
    const int total_chunks = (cols + MMQ_K - 1) / MMQ_K;
    const int c0 = blockIdx.z * k_chunks;
    const int c1 = min(c0 + k_chunks, total_chunks);

    // Only the first NI tiles of 8 tokens hold tokens (the rest of a short batch's tile is
    // zeros, never multiplied).
    float acc[NI][4];
#pragma unroll
    for (int j = 0; j < NI; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[j][e] = 0.0f;

    // A chunk of tokens: 8 halves a thread a step.
    constexpr int NX = MMQ_TOKENS * (MMQ_K / 8) / MMQ_THREADS;
    uint4 rx[NX];
    auto load_x = [&](int chunk) {
        const int k0 = chunk * MMQ_K;
#pragma unroll
        for (int it = 0; it < NX; it++) {
            int i = tid + it * MMQ_THREADS;
            int t = i / (MMQ_K / 8), c = (i % (MMQ_K / 8)) * 8;
            rx[it] = t0 + t < nt && k0 + c < cols
                         ? *(const uint4*)(xh + (u64)(t0 + t) * cols + k0 + c)
                         : make_uint4(0, 0, 0, 0);
        }
    };

    MmqFrag cur, nxt;
    if (c0 < c1) {
        load_x(c0);
        mmq_frag_load<TY>(cur, wa, wb, c0 * MMQ_K, cols, tig);
    }
    for (int chunk = c0; chunk < c1; chunk++) {
#pragma unroll
        for (int it = 0; it < NX; it++) {
            int i = tid + it * MMQ_THREADS;
            uint4 v = rx[it], o;
            o.x = __byte_perm(v.x, v.y, 0x5410);
            o.y = __byte_perm(v.x, v.y, 0x7632);
            o.z = __byte_perm(v.z, v.w, 0x5410);
            o.w = __byte_perm(v.z, v.w, 0x7632);
            *(uint4*)&sx[(i / (MMQ_K / 8)) * MMQ_LDH + (i % (MMQ_K / 8)) * 8] = o;
        }
        __syncthreads();
        if (chunk + 1 < c1) load_x(chunk + 1);
#pragma unroll
        for (int h = 0; h < MMQ_NH; h++) {
            // The next set's weights fly while this one is multiplied.
            if (h + 1 < MMQ_NH) {
                mmq_frag_load<TY>(nxt, wa, wb, chunk * MMQ_K + (h + 1) * 32 * MMQ_HG, cols, tig);
            } else if (chunk + 1 < c1) {
                mmq_frag_load<TY>(nxt, wa, wb, (chunk + 1) * MMQ_K, cols, tig);
            }
#pragma unroll
            for (int gg = 0; gg < MMQ_HG; gg++) {
                const int g = h * MMQ_HG + gg;
                // A fragments of the group's two halves of 16 columns: rows g and g + 8,
                // values 4t.. of each half.
                u32 a[2][4];
#pragma unroll
                for (int half = 0; half < 2; half++) {
                    const int si = SUB == 16 ? half : 0;
#pragma unroll
                    for (int r = 0; r < 2; r++) {
                        mmq_halves<MIN>(cur.q[gg][2 * half + r], h2_of(cur.s[gg][r][si]),
                                        h2_of(MIN ? -cur.m[gg][r] : 0.0f), &a[half][r],
                                        &a[half][2 + r]);
                    }
                }
#pragma unroll
                for (int ni = 0; ni < NI; ni++) {
                    const u16* p = &sx[(ni * 8 + gid) * MMQ_LDH + g * 32 + 4 * tig];
                    const uint2 b0 = *(const uint2*)p, b1 = *(const uint2*)(p + 16);
                    mmq_mma(acc[ni], a[0][0], a[0][1], a[0][2], a[0][3], b0.x, b0.y);
                    mmq_mma(acc[ni], a[1][0], a[1][1], a[1][2], a[1][3], b1.x, b1.y);
                }
            }
            cur = nxt;
        }
        __syncthreads();
    }

    dst += blockIdx.z * split_stride;
#pragma unroll
    for (int ni = 0; ni < NI; ni++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int r = ra + (e >> 1) * 8;
            int t = t0 + ni * 8 + 2 * tig + (e & 1);
            if (r < rows && t < nt) {
                float* o = dst + (u64)t * ldd + r;
                float v = acc[ni][e] * xs[t];
                *o = accumulate ? *o + v : v;
            }
        }
}

#define MMQ_ENTRY(name, ty)                                                                    \
    extern "C" __global__ void __launch_bounds__(MMQ_THREADS)                 \
        name(const u8* __restrict__ w, u64 row_bytes, int rows, int cols,                     \
             const u16* __restrict__ xh, const float* __restrict__ xs, int nt, int k_chunks, \
             float* __restrict__ dst, int ldd, u64 split_stride, int accumulate) {            \
        if (nt - (int)blockIdx.x * MMQ_TOKENS > MMQ_TOKENS / 2) {                              \
            mmq_block<ty, MMQ_TOKENS / 8>(w, row_bytes, rows, cols, xh, xs, nt, k_chunks, dst,   \
                                          ldd, split_stride, accumulate);                      \
        } else {                                                                               \
            mmq_block<ty, MMQ_TOKENS / 16>(w, row_bytes, rows, cols, xh, xs, nt, k_chunks, dst,  \
                                           ldd, split_stride, accumulate);                     \
        }                                                                                      \
    }

MMQ_ENTRY(mmq_q4_0, TY_Q4_0)
MMQ_ENTRY(mmq_q4_0p, TY_Q4_0P)
MMQ_ENTRY(mmq_q8_0, TY_Q8_0)
MMQ_ENTRY(mmq_q8_0p, TY_Q8_0P)
MMQ_ENTRY(mmq_q4_k, TY_Q4_K)
MMQ_ENTRY(mmq_q5_k, TY_Q5_K)
MMQ_ENTRY(mmq_q6_k, TY_Q6_K)
MMQ_ENTRY(mmq_q6_kp, TY_Q6_KP)
MMQ_ENTRY(mmq_iq4_xs, TY_IQ4_XS)
MMQ_ENTRY(mmq_iq4_xsp, TY_IQ4_XSP)

// Token t of x (cols f32) as f16 times 1 / xs[t], xs[t] the least power of two at or above
// its largest magnitude (1 for a row of zeros): dividing by a power of two is exact, so
// only the f16 rounding remains. Launch: one block of MMQ_THREADS per token.
extern "C" __global__ void __launch_bounds__(MMQ_THREADS)
    mmq_tokens_f16(const float* __restrict__ x, int cols, u16* __restrict__ xh,
                   float* __restrict__ xs) {
    __shared__ float part[MMQ_THREADS / 32];
    const u64 t = blockIdx.x;
    const float* row = x + t * cols;
    float m = 0.0f;
    for (int c = threadIdx.x; c < cols; c += MMQ_THREADS) m = fmaxf(m, fabsf(row[c]));
    m = warp_max(m);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = m;
    __syncthreads();
    m = 0.0f;
#pragma unroll
    for (int i = 0; i < MMQ_THREADS / 32; i++) m = fmaxf(m, part[i]);
    // The exponent of m, rounded up: frexp gives m = f * 2^e with f in [0.5, 1).
    int e = 0;
    float f = frexpf(m, &e);
    const float s = m > 0.0f && isfinite(m) ? ldexpf(1.0f, f == 0.5f ? e - 1 : e) : 1.0f;
    const float inv = 1.0f / s;
    for (int c = threadIdx.x; c < cols; c += MMQ_THREADS) xh[t * cols + c] = f2h(row[c] * inv);
    if (threadIdx.x == 0) xs[t] = s;
}
