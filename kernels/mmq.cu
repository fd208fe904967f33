// Products of 17 to a few hundred tokens over quantized weights on the int8 tensor cores,
// read straight from their blocks: no f16 copy of the weight is made. The activations come
// quantized once to 8 bits per 32 values (xq [nt][cols], (scale, scale * sum) pairs
// xds [nt][cols / 32], as quantize_q8 writes them).
//
// A block computes MMQ_ROWS weight rows x MMQ_TOKENS tokens. For each chunk of MMQ_K
// columns it decodes its rows' quants to signed bytes in shared memory (one float scale per
// MMQ_SUB values, and for Q4_K / Q5_K the float min) next to the tokens' 8-bit values and
// scales; each of the 4 warps then multiplies 32 rows x 32 tokens with mma m16n8k32
// (m16n8k16 for Q6_K, whose scales cover 16 values) and adds every int32 block sum times
// its weight scale times its activation scale (less min x activation sum) to f32
// accumulators. Each thread holds its share of a chunk's loads in registers: all of them
// are issued together, one chunk ahead of the multiplications (the first version loaded
// and stored one word at a time and ran at half the GEMM's speed on an H200). Decoding a
// tile once for 64 tokens is meant to beat the GEMM's pass writing the whole weight as f16
// and reading it back; the host keeps these kernels off until that is measured.
//
// Launch: blockDim.x = MMQ_THREADS, grid (ceil(nt / MMQ_TOKENS), ceil(rows / MMQ_ROWS),
// splits); split z takes chunks [z * k_chunks, (z + 1) * k_chunks) of MMQ_K columns and
// writes its partial sums at dst + z * split_stride, element (t, r) at t * ldd + r
// (gemm_reduce adds them); with one split that is the result, added to what dst holds
// when `accumulate`. cols is a multiple of 32 (of 256 for K-quants and packed rows), xq
// rows 16-byte aligned. Rows and tokens past the ends read as zero and are never written.
// Needs sm_80 (the host launches it only there).

#define MMQ_ROWS 64
#define MMQ_TOKENS 64
#define MMQ_K 256
#define MMQ_THREADS 128
// Shared-memory row pitch in bytes: 272 puts the 8 rows one fragment load touches on
// different banks.
#define MMQ_LD (MMQ_K + 16)

// 4 bytes at a 2-byte aligned address (GGUF's Q4_0 / Q8_0 / Q6_K blocks).
__device__ __forceinline__ u32 mmq_ld32_2(const u8* p) {
    return (u32)ld16(p) | ((u32)ld16(p + 2) << 16);
}

// Signed bytes b - bias from unsigned bytes b < 128 (bias 8 or 32): adding 128 - bias
// never carries, and flipping the top bit subtracts 128.
__device__ __forceinline__ u32 mmq_unbias(u32 v, u32 bias) {
    u32 add = (128u - bias) * 0x01010101u;
    return (v + add) ^ 0x80808080u;
}

// Values per scale of type TY: 16 for Q6_K, 32 for the others.
template <int TY>
__device__ __forceinline__ constexpr int mmq_sub() {
    return (TY == TY_Q6_K || TY == TY_Q6_KP) ? 16 : 32;
}

template <int TY>
__device__ __forceinline__ constexpr bool mmq_has_min() {
    return TY == TY_Q4_K || TY == TY_Q5_K;
}

// Quants k..k+3 (k a multiple of 4) of a row of type TY as 4 signed bytes, without their
// scales: value = scale * byte (- min for Q4_K / Q5_K).
template <int TY>
__device__ __forceinline__ u32 mmq_word(const u8* row, int k) {
    if (TY == TY_Q4_0 || TY == TY_Q4_0P) {
        int b = k >> 5, j = k & 31;
        u32 x;
        if (TY == TY_Q4_0P) {
            x = *(const u32*)(row + (b >> 3) * 144 + 16 + 16 * (b & 7) + (j & 15));
        } else {
            x = mmq_ld32_2(row + b * 18 + 2 + (j & 15));
        }
        return mmq_unbias((j < 16 ? x : x >> 4) & 0x0F0F0F0Fu, 8);
    } else if (TY == TY_Q8_0 || TY == TY_Q8_0P) {
        int b = k >> 5, j = k & 31;
        if (TY == TY_Q8_0P) return *(const u32*)(row + (b >> 3) * 272 + 16 + 32 * (b & 7) + j);
        return mmq_ld32_2(row + b * 34 + 2 + j);
    } else if (TY == TY_Q4_K || TY == TY_Q5_K) {
        bool five = TY == TY_Q5_K;
        const u8* b = row + (k >> 8) * (five ? 176 : 144);
        int i = k & 255, g = i >> 6, kk = i & 63, l = kk & 31;
        u32 x = *(const u32*)(b + (five ? 48 : 16) + 32 * g + l);
        u32 v = (kk < 32 ? x : x >> 4) & 0x0F0F0F0Fu;
        if (five) {
            int s = 2 * g + (kk >= 32);
            v |= ((*(const u32*)(b + 16 + l) >> s) & 0x01010101u) << 4;
        }
        return v;
    } else if (TY == TY_Q6_K || TY == TY_Q6_KP) {
        const u8* b;
        float d;
        q6_k_block(TY, row, k >> 8, &b, &d);
        int i = k & 255, h = i >> 7, r = i & 127, kq = r >> 5, l = r & 31;
        u32 ql = mmq_ld32_2(b + 64 * h + l + 32 * (kq & 1));
        u32 nib = (kq < 2 ? ql : ql >> 4) & 0x0F0F0F0Fu;
        u32 hb = (mmq_ld32_2(b + 128 + 32 * h + l) >> (2 * kq)) & 0x03030303u;
        return mmq_unbias(nib | (hb << 4), 32);
    } else {  // IQ4_XS, GGUF or packed
        const u8 *head, *qs;
        iq4_xs_block(TY, row, k >> 8, &head, &qs);
        int i = k & 255, ib = i >> 5, j = i & 31;
        u32 x = *(const u32*)(qs + 16 * ib + (j & 15));
        u32 nib = (j < 16 ? x : x >> 4) & 0x0F0F0F0Fu;
        u32 v = 0;
#pragma unroll
        for (int s = 0; s < 4; s++) {
            int n = (nib >> (8 * s)) & 15;
            u32 q = n & 8 ? byte_of(0x26190D01u, 0x71594535u, n) : byte_of(0xBFAD9881u, 0xF6EADDCFu, n);
            v |= q << (8 * s);
        }
        return v;
    }
}

// Scale (and min) of the MMQ_SUB-value group grp of a row of type TY.
template <int TY>
__device__ __forceinline__ void mmq_scale(const u8* row, int grp, float* s, float* m) {
    *m = 0.0f;
    if (TY == TY_Q4_0 || TY == TY_Q8_0) {
        *s = h2f(ld16(row + grp * (TY == TY_Q4_0 ? 18 : 34)));
    } else if (TY == TY_Q4_0P || TY == TY_Q8_0P) {
        *s = h2f(ld16(row + (grp >> 3) * (TY == TY_Q4_0P ? 144 : 272) + 2 * (grp & 7)));
    } else if (TY == TY_Q4_K || TY == TY_Q5_K) {
        const u8* b = row + (grp >> 3) * (TY == TY_Q5_K ? 176 : 144);
        int sc, mn;
        scale_min_k4(grp & 7, b + 4, &sc, &mn);
        *s = h2f(ld16(b)) * (float)sc;
        *m = h2f(ld16(b + 2)) * (float)mn;
    } else if (TY == TY_Q6_K || TY == TY_Q6_KP) {
        const u8* b;
        float d;
        q6_k_block(TY, row, grp >> 4, &b, &d);
        *s = d * (float)(i8)b[192 + (grp & 15)];
    } else {
        const u8 *head, *qs;
        iq4_xs_block(TY, row, grp >> 3, &head, &qs);
        *s = h2f(ld16(head)) * (float)scale_iq4_xs(grp & 7, head);
    }
}

// mma m16n8k16 (s8): A registers 0 and 1 hold elements 4t..4t+3 of rows g and g + 8, B's
// one register elements 4t..4t+3 of token g; C as m16n8k32's.
__device__ __forceinline__ void mmq_mma16(int (&c)[4], u32 a0, u32 a1, u32 b0) {
#if __CUDA_ARCH__ >= 800
    asm(
        "mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, "
        "{%4, %5}, {%6}, {%7, %7, %7, %7};"
        : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
        : "r"(a0), "r"(a1), "r"(b0), "r"(0));
#else
    c[0] = c[1] = c[2] = c[3] = 0;
#endif
}

template <int TY>
__device__ __forceinline__ void mmq_block(const u8* __restrict__ w, u64 row_bytes, int rows,
                                          int cols, const i8* __restrict__ xq,
                                          const float2* __restrict__ xds, int nt, int k_chunks,
                                          float* __restrict__ dst, int ldd, u64 split_stride,
                                          int accumulate) {
    constexpr int SUB = mmq_sub<TY>();
    constexpr int GROUPS = MMQ_K / SUB;
    constexpr bool MIN = mmq_has_min<TY>();
    __shared__ __align__(16) i8 sw[MMQ_ROWS * MMQ_LD];
    __shared__ __align__(16) i8 sx[MMQ_TOKENS * MMQ_LD];
    __shared__ float sws[MMQ_ROWS][GROUPS];
    __shared__ float swm[MIN ? MMQ_ROWS : 1][MIN ? 8 : 1];
    __shared__ float2 sxd[MMQ_TOKENS][MMQ_K / 32];

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int gid = lane >> 2, tig = lane & 3;
    const int t0 = blockIdx.x * MMQ_TOKENS, r0 = blockIdx.y * MMQ_ROWS;
    // Warp tile: rows wr..wr+31, tokens wt..wt+31.
    const int wr = (warp & 1) * 32, wt = (warp >> 1) * 32;
    const int total_chunks = (cols + MMQ_K - 1) / MMQ_K;
    const int c0 = blockIdx.z * k_chunks;
    const int c1 = min(c0 + k_chunks, total_chunks);
    const int groups32 = cols / 32;

    float acc[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.0f;

    // Per thread: the loads of one chunk, held in registers so that every load of a chunk
    // is in flight at once, and the next chunk's fly while this one is multiplied.
    constexpr int NW = MMQ_ROWS * (MMQ_K / 4) / MMQ_THREADS;
    constexpr int NS = MMQ_ROWS * GROUPS / MMQ_THREADS;
    constexpr int NX = MMQ_TOKENS * (MMQ_K / 16) / MMQ_THREADS;
    constexpr int ND = MMQ_TOKENS * (MMQ_K / 32) / MMQ_THREADS;
    u32 rw[NW];
    float rs[NS], rm[NS];
    uint4 rx[NX];
    float2 rd[ND];
    auto load = [&](int chunk) {
        const int k0 = chunk * MMQ_K;
#pragma unroll
        for (int it = 0; it < NW; it++) {
            int i = tid + it * MMQ_THREADS;
            int r = i / (MMQ_K / 4), kw = (i % (MMQ_K / 4)) * 4;
            rw[it] = r0 + r < rows && k0 + kw < cols
                         ? mmq_word<TY>(w + (u64)(r0 + r) * row_bytes, k0 + kw)
                         : 0u;
        }
#pragma unroll
        for (int it = 0; it < NS; it++) {
            int i = tid + it * MMQ_THREADS;
            int r = i / GROUPS, g = i % GROUPS;
            rs[it] = rm[it] = 0.0f;
            if (r0 + r < rows && k0 + g * SUB < cols)
                mmq_scale<TY>(w + (u64)(r0 + r) * row_bytes, (k0 + g * SUB) / SUB, &rs[it], &rm[it]);
        }
#pragma unroll
        for (int it = 0; it < NX; it++) {
            int i = tid + it * MMQ_THREADS;
            int t = i / (MMQ_K / 16), c = (i % (MMQ_K / 16)) * 16;
            rx[it] = t0 + t < nt && k0 + c < cols
                         ? *(const uint4*)(xq + (u64)(t0 + t) * cols + k0 + c)
                         : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int it = 0; it < ND; it++) {
            int i = tid + it * MMQ_THREADS;
            int t = i / (MMQ_K / 32), g = i % (MMQ_K / 32);
            rd[it] = t0 + t < nt && k0 / 32 + g < groups32
                         ? xds[(u64)(t0 + t) * groups32 + k0 / 32 + g]
                         : make_float2(0.0f, 0.0f);
        }
    };
    if (c0 < c1) load(c0);

    for (int chunk = c0; chunk < c1; chunk++) {
#pragma unroll
        for (int it = 0; it < NW; it++) {
            int i = tid + it * MMQ_THREADS;
            *(u32*)&sw[(i / (MMQ_K / 4)) * MMQ_LD + (i % (MMQ_K / 4)) * 4] = rw[it];
        }
#pragma unroll
        for (int it = 0; it < NS; it++) {
            int i = tid + it * MMQ_THREADS;
            sws[i / GROUPS][i % GROUPS] = rs[it];
            if (MIN) swm[i / GROUPS][i % GROUPS] = rm[it];
        }
#pragma unroll
        for (int it = 0; it < NX; it++) {
            int i = tid + it * MMQ_THREADS;
            *(uint4*)&sx[(i / (MMQ_K / 16)) * MMQ_LD + (i % (MMQ_K / 16)) * 16] = rx[it];
        }
#pragma unroll
        for (int it = 0; it < ND; it++) {
            int i = tid + it * MMQ_THREADS;
            sxd[i / (MMQ_K / 32)][i % (MMQ_K / 32)] = rd[it];
        }
        __syncthreads();
        if (chunk + 1 < c1) load(chunk + 1);

#pragma unroll 2
        for (int g = 0; g < MMQ_K / 32; g++) {
            const int kb = g * 32 + 4 * tig;
            u32 b[4][2];
#pragma unroll
            for (int ni = 0; ni < 4; ni++) {
                const i8* p = &sx[(wt + ni * 8 + gid) * MMQ_LD + kb];
                b[ni][0] = *(const u32*)p;
                b[ni][1] = *(const u32*)(p + 16);
            }
            // Activation scales of this thread's 8 tokens.
            float2 xd[4][2];
#pragma unroll
            for (int ni = 0; ni < 4; ni++)
#pragma unroll
                for (int e = 0; e < 2; e++) xd[ni][e] = sxd[wt + ni * 8 + 2 * tig + e][g];
#pragma unroll
            for (int mi = 0; mi < 2; mi++) {
                const int ra = wr + mi * 16 + gid;
                const i8* p0 = &sw[ra * MMQ_LD + kb];
                const i8* p1 = &sw[(ra + 8) * MMQ_LD + kb];
                u32 a[4] = {*(const u32*)p0, *(const u32*)p1, *(const u32*)(p0 + 16),
                            *(const u32*)(p1 + 16)};
                // Weight scales (and mins) of rows ra and ra + 8; Q6_K's two per half.
                float ws[2][2], wm[2];
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    ws[e][0] = sws[ra + 8 * e][SUB == 32 ? g : 2 * g];
                    ws[e][1] = sws[ra + 8 * e][SUB == 32 ? g : 2 * g + 1];
                    wm[e] = MIN ? swm[ra + 8 * e][g] : 0.0f;
                }
#pragma unroll
                for (int ni = 0; ni < 4; ni++) {
                    if (SUB == 32) {
                        int c[4];
                        mma_8bit<false>(c, a, b[ni][0], b[ni][1]);
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            float2 x = xd[ni][e & 1];
                            float v = ws[e >> 1][0] * x.x * (float)c[e];
                            if (MIN) v -= wm[e >> 1] * x.y;
                            acc[mi][ni][e] += v;
                        }
                    } else {
                        // Two halves of 16 values, each with its own weight scale.
#pragma unroll
                        for (int h = 0; h < 2; h++) {
                            int c[4];
                            mmq_mma16(c, a[2 * h], a[2 * h + 1], b[ni][h]);
#pragma unroll
                            for (int e = 0; e < 4; e++) {
                                acc[mi][ni][e] += ws[e >> 1][h] * xd[ni][e & 1].x * (float)c[e];
                            }
                        }
                    }
                }
            }
        }
        __syncthreads();
    }

    dst += blockIdx.z * split_stride;
#pragma unroll
    for (int mi = 0; mi < 2; mi++)
#pragma unroll
        for (int ni = 0; ni < 4; ni++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int r = r0 + wr + mi * 16 + gid + (e >> 1) * 8;
                int t = t0 + wt + ni * 8 + 2 * tig + (e & 1);
                if (r < rows && t < nt) {
                    float* o = dst + (u64)t * ldd + r;
                    *o = accumulate ? *o + acc[mi][ni][e] : acc[mi][ni][e];
                }
            }
}

#define MMQ_ENTRY(name, ty)                                                                    \
    extern "C" __global__ void __launch_bounds__(MMQ_THREADS)                                 \
        name(const u8* __restrict__ w, u64 row_bytes, int rows, int cols,                     \
             const i8* __restrict__ xq, const float2* __restrict__ xds, int nt, int k_chunks, \
             float* __restrict__ dst, int ldd, u64 split_stride, int accumulate) {            \
        mmq_block<ty>(w, row_bytes, rows, cols, xq, xds, nt, k_chunks, dst, ldd, split_stride, \
                      accumulate);                                                             \
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
