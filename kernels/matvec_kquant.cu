// Decode products over K-quant weights — Q4_K, Q5_K (GGUF layout), Q3_K, Q6_K and IQ4_XS
// (packed layouts, below) — with activations in 8-bit blocks of 32 (values xq [nt][cols], (scale,
// scale * sum) pairs xds [nt][cols / 32]), multiplied with dp4a as matvec_packed.cu does for
// Q4_0 and Q8_0. The f32 kernels of matvec.cu read 4 weight bytes a lane and 32 bytes of x
// per 4 values; here a lane reads 16 bytes of quants (32 values) and 32 bytes of 8-bit x.
//
// The unit of work is a chunk: 16 bytes of a block's low quant bits, which hold 16
// consecutive values of two sub-blocks (run A in the low nibbles, run B in the high ones).
// A 256-value block has 8 chunks, so a warp round covers 4 blocks of a row: lane l takes
// chunk l % 8 of block l / 8, and U rounds are loaded before any is used (bytes in flight
// cover the memory latency). Chunk c of a block is:
//   Q4_K / Q5_K: group g = c / 2 of 64 values, half h = c % 2: run A is values 16h..16h+16
//                of sub-block 2g, run B the same values of sub-block 2g + 1;
//   Q6_K:        half hh = c / 4 of 128 values, quarter kk = (c / 2) % 2, s = c % 2: run A
//                is values 16s..16s+16 of quarter kk, run B of quarter kk + 2;
//   Q3_K:        half n = c / 4, s = (c / 2) % 2, jj = c % 2: 16 bytes of qs hold values
//                16s..16s+16 of the four 32-value runs j of half n; run A is j = 2jj, run B
//                j = 2jj + 1 (two lanes load the same bytes and take two runs each);
//   IQ4_XS:      sub-block c of 32: run A its values 0..16, run B 16..32; a nibble is an
//                index into 16 fixed levels (iq4_values).
//
// Q6_K's 210-byte and Q3_K's 110-byte blocks allow only 2-byte loads and IQ4_XS's 136-byte
// ones 8-byte loads, so pack_q6_k, pack_q3_k and pack_iq4_xs (at the end) rewrite rows of
// whole 8-block groups in place. pack_iq4_xs puts the 8 blocks' 8-byte headers (d,
// scales_h, scales_l) first, then their 128-byte qs. pack_q6_k rewrites each group of 8
// blocks of a row (1680 bytes) in place: the 8 f16 scales d first (16 bytes), then each
// block's other 208 bytes (ql, qh, scales), 16-byte aligned. Rows hold a multiple of 2048
// values (whole groups; checked on the host). TY_Q6_KP in common.cuh names this layout.
//
// The MoE expert kernels (MOE_ENTRIES, at the end) also read Q6_K in GGUF's layout
// (TY_Q6_K: the same chunks, loaded 2 bytes at a time), for expert rows that do not pack.
//
// Launch shapes and arguments are the packed kernels' (the drivers in common.cuh, KQ_R rows
// a warp), n <= NT (1, 2, 4, 8); cols a multiple of 256 (2048 for Q6_K), w and every row
// 16-byte aligned.
// Rows a warp takes.
#define KQ_R 2

__device__ __forceinline__ int dp4a_ss(int a, int b, int c) {
    int d;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// Byte k (0..16, known only at run time) of v, without indexing a register array (which
// would go through local memory).
__device__ __forceinline__ u32 byte_of(uint4 v, int k) {
    u32 w = k < 8 ? (k < 4 ? v.x : v.y) : (k < 12 ? v.z : v.w);
    return (w >> (8 * (k & 3))) & 255u;
}

// 8 bytes that are read once, past L1 (8-byte aligned).
__device__ __forceinline__ uint2 ld_stream8(const u8* p) {
    uint2 v;
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}

// The loaded bytes of one chunk of one row.
struct KqChunk {
    uint4 head;  // Q4_K/Q5_K: d, dmin, the 12 scale bytes; Q6_K: the 16 i8 scales
    uint4 q;     // the chunk's 16 bytes of low bits
    uint4 hi;    // Q5_K / Q6_K: the 16 bytes of high bits for its values
    float d;     // Q6_K: the block's scale
};

// What a chunk contributes per token, once decoded: run A's and B's quants as 4 words of
// bytes each, their scales, and (Q4_K/Q5_K) the min terms.
struct KqRuns {
    int a[4], b[4];
    float da, db;  // weight scale of each run (times the activation scale per token)
    float ma, mb;  // weight min of each run (times the activation scale · sum); 0 on Q6_K
};

// Whether TY is Q6_K in either layout: GGUF's (2-byte aligned blocks, the MoE experts whose
// rows do not pack) or the packed one.
#define KQ_Q6(TY) ((TY) == TY_Q6_KP || (TY) == TY_Q6_K)

// 16 bytes at a 2-byte aligned address, read once (GGUF's Q6_K blocks).
__device__ __forceinline__ uint4 ld16_unaligned(const u8* p) {
    const u16* h = (const u16*)p;
    return make_uint4((u32)h[0] | ((u32)h[1] << 16), (u32)h[2] | ((u32)h[3] << 16),
                      (u32)h[4] | ((u32)h[5] << 16), (u32)h[6] | ((u32)h[7] << 16));
}

template <int TY>
__device__ __forceinline__ void kq_load(const u8* row, int b, int c, KqChunk& k) {
    if (TY == TY_Q6_K) {
        const u8* body = row + (size_t)b * 210;
        int hh = c >> 2, s = c & 1;
        k.d = h2f(ld16(body + 208));
        k.head = ld16_unaligned(body + 192);
        k.q = ld16_unaligned(body + 16 * c);
        k.hi = ld16_unaligned(body + 128 + 32 * hh + 16 * s);
    } else if (TY == TY_Q6_KP) {
        const u8* g = row + (size_t)(b >> 3) * 1680;
        const u8* body = g + 16 + 208 * (b & 7);
        int hh = c >> 2, s = c & 1;
        k.d = h2f(ld16(g + 2 * (b & 7)));
        k.head = ld_stream(body + 192);
        k.q = ld_stream(body + 16 * c);
        k.hi = ld_stream(body + 128 + 32 * hh + 16 * s);
    } else if (TY == TY_Q3_KP) {
        const u8* g = row + (size_t)(b >> 3) * 880;
        int i = b & 7, n = c >> 2, s = (c >> 1) & 1;
        const u32* sc = (const u32*)(g + 16 + 12 * i);
        k.d = h2f(ld16(g + 2 * i));
        k.head = make_uint4(sc[0], sc[1], sc[2], 0);
        k.hi = ld_stream(g + 112 + 32 * i + 16 * s);
        k.q = ld_stream(g + 368 + 64 * i + 32 * n + 16 * s);
    } else if (TY == TY_IQ4_XSP) {
        const u8* g = row + (size_t)(b >> 3) * 1088;
        int i = b & 7;
        uint2 h = ld_stream8(g + 8 * i);
        k.head = make_uint4(h.x, h.y, 0, 0);
        k.q = ld_stream(g + 64 + 128 * i + 16 * c);
        k.hi = make_uint4(0, 0, 0, 0);
        k.d = 0.f;
    } else {
        const bool five = TY == TY_Q5_K;
        const u8* blk = row + (size_t)b * (five ? 176 : 144);
        k.head = ld_stream(blk);
        k.q = ld_stream(blk + (five ? 48 : 16) + 16 * c);
        k.hi = five ? ld_stream(blk + 16 + 16 * (c & 1)) : make_uint4(0, 0, 0, 0);
        k.d = 0.f;
    }
}

// The 6-bit scale (biased by 32) of Q3_K sub-block i from its 12 scale bytes (head.x..z):
// low 4 bits from byte i % 8 (high nibble from i = 8 on), high 2 from byte 8 + i % 4.
__device__ __forceinline__ int q3_k_scale(uint4 head, int i) {
    u32 low = (byte_of(head, i & 7) >> (4 * (i >> 3))) & 15u;
    u32 high = (byte_of(head, 8 + (i & 3)) >> (2 * (i >> 2))) & 3u;
    return (int)(low | (high << 4));
}

// Scale and min of sub-block j from the 12 scale bytes at bytes 4..16 of head.
__device__ __forceinline__ void kq_scale_min(uint4 head, int j, int* sc, int* m) {
    if (j < 4) {
        *sc = byte_of(head, 4 + j) & 63;
        *m = byte_of(head, 8 + j) & 63;
    } else {
        u32 q = byte_of(head, 8 + j);
        *sc = (q & 15) | ((byte_of(head, j) >> 6) << 4);
        *m = (q >> 4) | ((byte_of(head, 4 + j) >> 6) << 4);
    }
}

template <int TY>
__device__ __forceinline__ void kq_decode(const KqChunk& k, int c, KqRuns& r) {
    const u32 m4 = 0x0F0F0F0Fu;
    u32 q[4] = {k.q.x, k.q.y, k.q.z, k.q.w};
    u32 h[4] = {k.hi.x, k.hi.y, k.hi.z, k.hi.w};
    if (KQ_Q6(TY)) {
        int hh = c >> 2, kk = (c >> 1) & 1, s = c & 1;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            u32 lo = (q[i] & m4) | (((h[i] >> (2 * kk)) & 0x03030303u) << 4);
            u32 hi = ((q[i] >> 4) & m4) | (((h[i] >> (2 * kk + 4)) & 0x03030303u) << 4);
            // 6-bit q to the signed byte q - 32: flip bit 5, then copy it into bits 6 and 7.
            lo ^= 0x20202020u;
            hi ^= 0x20202020u;
            r.a[i] = (int)(lo | ((lo & 0x20202020u) * 6u));
            r.b[i] = (int)(hi | ((hi & 0x20202020u) * 6u));
        }
        int at = 8 * hh + s + 2 * kk;
        r.da = k.d * (float)(i8)byte_of(k.head, at);
        r.db = k.d * (float)(i8)byte_of(k.head, at + 4);
        r.ma = r.mb = 0.f;
    } else if (TY == TY_Q3_KP) {
        int n = c >> 2, s = (c >> 1) & 1, jj = c & 1;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            // 2 low bits and the hmask bit; a clear hmask bit lowers the value by 4, so
            // low | bit << 2 is the value + 4: flip bit 2, then copy it into bits 3..7.
            u32 va = ((q[i] >> (4 * jj)) & 0x03030303u) | (((h[i] >> (4 * n + 2 * jj)) & 0x01010101u) << 2);
            u32 vb = ((q[i] >> (4 * jj + 2)) & 0x03030303u) | (((h[i] >> (4 * n + 2 * jj + 1)) & 0x01010101u) << 2);
            va ^= 0x04040404u;
            vb ^= 0x04040404u;
            r.a[i] = (int)(va | ((va & 0x04040404u) * 0x3Eu));
            r.b[i] = (int)(vb | ((vb & 0x04040404u) * 0x3Eu));
        }
        int at = 8 * n + 4 * jj + s;
        r.da = k.d * (float)(q3_k_scale(k.head, at) - 32);
        r.db = k.d * (float)(q3_k_scale(k.head, at + 2) - 32);
        r.ma = r.mb = 0.f;
    } else if (TY == TY_IQ4_XSP) {
#pragma unroll
        for (int i = 0; i < 4; i++) iq4_values(q[i], &r.a[i], &r.b[i]);
        // Sub-block c's 6-bit scale: 4 bits from scales_l, 2 from scales_h.
        int ls = (int)((k.head.y >> (4 * c)) & 15) | (int)(((k.head.x >> (16 + 2 * c)) & 3) << 4);
        r.da = r.db = h2f(k.head.x & 0xffffu) * (float)(ls - 32);
        r.ma = r.mb = 0.f;
    } else {
        const bool five = TY == TY_Q5_K;
        int g = c >> 1;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            u32 lo = q[i] & m4, hi = (q[i] >> 4) & m4;
            if (five) {
                lo |= ((h[i] >> (2 * g)) & 0x01010101u) << 4;
                hi |= ((h[i] >> (2 * g + 1)) & 0x01010101u) << 4;
            }
            r.a[i] = (int)lo;
            r.b[i] = (int)hi;
        }
        int sc1, m1, sc2, m2;
        kq_scale_min(k.head, 2 * g, &sc1, &m1);
        kq_scale_min(k.head, 2 * g + 1, &sc2, &m2);
        float d = h2f(k.head.x & 0xffffu), dmin = h2f(k.head.x >> 16);
        r.da = d * (float)sc1;
        r.db = d * (float)sc2;
        // Each run is half a sub-block; the half-0 chunk carries the whole sub-block's min
        // term (scale · sum of its 32 activations, which xds holds).
        bool first = (c & 1) == 0;
        r.ma = first ? dmin * (float)m1 : 0.f;
        r.mb = first ? dmin * (float)m2 : 0.f;
    }
}

// (offset in the block's 256 activations, 32-block index) of run A of chunk c; run B is
// KQ_B_OFF values and KQ_B_BLK 32-blocks further.
template <int TY>
__device__ __forceinline__ int kq_run_a(int c, int* blk32) {
    if (KQ_Q6(TY)) {
        int hh = c >> 2, kk = (c >> 1) & 1, s = c & 1;
        *blk32 = 4 * hh + kk;
        return 128 * hh + 32 * kk + 16 * s;
    }
    if (TY == TY_IQ4_XSP) {
        *blk32 = c;
        return 32 * c;
    }
    if (TY == TY_Q3_KP) {
        int n = c >> 2, s = (c >> 1) & 1, jj = c & 1;
        *blk32 = 4 * n + 2 * jj;
        return 128 * n + 64 * jj + 16 * s;
    }
    int g = c >> 1, h = c & 1;
    *blk32 = 2 * g;
    return 64 * g + 16 * h;
}

template <int TY>
__device__ __forceinline__ float kq_dot(const KqRuns& r, int4 xa, int4 xb, float2 sa, float2 sb) {
    int da, db;
    if (KQ_Q6(TY) || TY == TY_IQ4_XSP || TY == TY_Q3_KP) {
        da = dp4a_ss(r.a[0], xa.x, dp4a_ss(r.a[1], xa.y, dp4a_ss(r.a[2], xa.z, dp4a_ss(r.a[3], xa.w, 0))));
        db = dp4a_ss(r.b[0], xb.x, dp4a_ss(r.b[1], xb.y, dp4a_ss(r.b[2], xb.z, dp4a_ss(r.b[3], xb.w, 0))));
    } else {
        da = dp4a_us((u32)r.a[0], xa.x, dp4a_us((u32)r.a[1], xa.y, dp4a_us((u32)r.a[2], xa.z, dp4a_us((u32)r.a[3], xa.w, 0))));
        db = dp4a_us((u32)r.b[0], xb.x, dp4a_us((u32)r.b[1], xb.y, dp4a_us((u32)r.b[2], xb.z, dp4a_us((u32)r.b[3], xb.w, 0))));
    }
    return r.da * sa.x * (float)da + r.db * sb.x * (float)db - r.ma * sa.y - r.mb * sb.y;
}

// Adds this lane's share of row[r] . x[t] to acc[r][t] for the R rows at rowp and t < nt.
template <int TY, int NT, int R, int U>
__device__ __forceinline__ void kq_rows(const u8* const (&rowp)[R], int cols, const i8* xq,
                                        const float2* xds, int nt, int lane, bool& waited,
                                        float (&acc)[R][NT]) {
    const int b_off = KQ_Q6(TY) ? 64 : TY == TY_IQ4_XSP ? 16 : 32;
    const int b_blk = KQ_Q6(TY) ? 2 : TY == TY_IQ4_XSP ? 0 : 1;
    int chunks = (cols / 256) * 8, nb32 = cols / 32;
    for (int k0 = lane; k0 < chunks; k0 += 32 * U) {
        KqChunk w[U][R];
#pragma unroll
        for (int u = 0; u < U; u++) {
            int k = k0 + 32 * u;
            if (k < chunks) {
#pragma unroll
                for (int r = 0; r < R; r++) kq_load<TY>(rowp[r], k >> 3, k & 7, w[u][r]);
            }
        }
        if (!waited) {
            pdl_wait();
            waited = true;
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            int k = k0 + 32 * u;
            if (k >= chunks) break;
            int b = k >> 3, c = k & 7, blk32;
            int off = b * 256 + kq_run_a<TY>(c, &blk32);
            blk32 += b * 8;
            if (TY == TY_IQ4_XSP && NT == 1 && U == 1) {
                // The gate/up kernel's one-round loop (registers capped at 64): x first, then
                // each row decoded right before its product, both runs in one dp4a chain (they
                // share the scale and the activation block). +1% tg128 on the IQ4_XS mix
                // (H100); in the four-round matvec the same order took 156 registers, not
                // 119, and ran 3% slower, and the one chain alone there 5% slower.
                const i8* xs = xq + off;
                int4 xa = *(const int4*)xs, xb = *(const int4*)(xs + b_off);
                float sx = xds[blk32].x;
#pragma unroll
                for (int r = 0; r < R; r++) {
                    KqRuns run;
                    kq_decode<TY>(w[u][r], c, run);
                    int s = dp4a_ss(run.a[0], xa.x, dp4a_ss(run.a[1], xa.y, dp4a_ss(run.a[2], xa.z, dp4a_ss(run.a[3], xa.w, 0))));
                    s = dp4a_ss(run.b[0], xb.x, dp4a_ss(run.b[1], xb.y, dp4a_ss(run.b[2], xb.z, dp4a_ss(run.b[3], xb.w, s))));
                    acc[r][0] += run.da * sx * (float)s;
                }
                continue;
            }
            KqRuns runs[R];
#pragma unroll
            for (int r = 0; r < R; r++) kq_decode<TY>(w[u][r], c, runs[r]);
#pragma unroll
            for (int t = 0; t < NT; t++) {
                if (t < nt) {
                    const i8* xs = xq + (size_t)t * cols + off;
                    int4 xa = *(const int4*)xs, xb = *(const int4*)(xs + b_off);
                    float2 sa = xds[(size_t)t * nb32 + blk32], sb = xds[(size_t)t * nb32 + blk32 + b_blk];
#pragma unroll
                    for (int r = 0; r < R; r++) acc[r][t] += kq_dot<TY>(runs[r], xa, xb, sa, sb);
                }
            }
        }
    }
    if (!waited) {
        pdl_wait();
        waited = true;
    }
}

// The row policy of the drivers in common.cuh for K-quant rows of type TY.
template <int TY>
struct KqRows {
    __device__ static size_t row_bytes(int cols) {
        return (size_t)(cols / 256) *
               (KQ_Q6(TY) ? 210
                : TY == TY_Q5_K ? 176
                : TY == TY_IQ4_XSP ? 136
                : TY == TY_Q3_KP ? 110
                                 : 144);
    }
    template <int NT, int R, int U>
    __device__ static void rows(const u8* const (&rowp)[R], int cols, const i8* xq,
                                const float2* xds, int nt, int lane, bool& waited,
                                float (&acc)[R][NT]) {
        kq_rows<TY, NT, R, U>(rowp, cols, xq, xds, nt, lane, waited, acc);
    }
};

// q/k/v in one launch: q and k of type TA, v of TB (TB differs in mixed files, whose attn_v
// has more bits: llama.cpp's Q3_K_M, Q4_K_M, Q5_K_M and IQ4_XS).
#define KQ3_MIXED(name, TA, TB, U, nt)                                                          \
    extern "C" __global__ void __launch_bounds__(32 * PK_MV_WARPS) matveck3_##name##_##nt(        \
        const u8* w0, const u8* w1, const u8* w2, int r0, int r1, int r2, int cols,              \
        const i8* xq, const float2* xds, int n, float* o0, float* o1, float* o2) {               \
        pk_matvec3_mixed<KqRows<TA>, KqRows<TA>, KqRows<TB>, nt, KQ_R, U>(                      \
            w0, w1, w2, r0, r1, r2, cols, xq, xds, n, o0, o1, o2);                               \
    }

// The product, q/k/v and gate/up entries of one type and token width (the drivers' launch
// shapes, common.cuh). The gate/up kernel loads one round at a time (U = 1): it holds gate
// and up sums in registers capped for two 512-thread blocks an SM.
#define KQ_ENTRIES(name, TY, U, nt)                                                              \
    extern "C" __global__ void __launch_bounds__(32 * PK_MV_WARPS) matveck_##name##_##nt(         \
        const u8* w, int rows, int cols, const i8* xq, const float2* xds, int n, float* out,     \
        int accum) {                                                                             \
        pk_matvec<KqRows<TY>, nt, KQ_R, U>(w, rows, cols, xq, xds, n, out, accum);              \
    }                                                                                            \
    KQ3_MIXED(name, TY, TY, U, nt)                                                               \
    extern "C" __global__ void __launch_bounds__(32 * PK_SW_ROWS / KQ_R, nt <= 2 ? 2 : 1)        \
        matveck_swiglu_##name##_##nt(const u8* wg, const u8* wu, int rows, int cols,             \
                                     const i8* xq, const float2* xds, int n, float* out, i8* oq, \
                                     float2* ods, int act) {                                     \
        pk_swiglu<KqRows<TY>, nt, KQ_R, 1>(wg, wu, rows, cols, xq, xds, n, out, oq, ods, act);  \
    }

#define KQ_ALL(name, TY, U) \
    KQ_ENTRIES(name, TY, U, 1) KQ_ENTRIES(name, TY, U, 2) KQ_ENTRIES(name, TY, U, 4) KQ_ENTRIES(name, TY, U, 8)

// Rounds in flight (U): IQ4_XS loads no high bits, so 4 rounds fit its registers and
// decoded 7.7% faster (H200, llama.cpp's IQ4_XS mix); Q4_K ran 3.4% slower with 4.
KQ_ALL(q4_k, TY_Q4_K, 2)
KQ_ALL(q5_k, TY_Q5_K, 2)
KQ_ALL(q6_k, TY_Q6_KP, 2)
KQ_ALL(iq4_xs, TY_IQ4_XSP, 4)
KQ_ALL(q3_k, TY_Q3_KP, 2)

#define KQ3_MIXED_ALL(name, TA, TB, U) \
    KQ3_MIXED(name, TA, TB, U, 1) KQ3_MIXED(name, TA, TB, U, 2) KQ3_MIXED(name, TA, TB, U, 4) KQ3_MIXED(name, TA, TB, U, 8)

KQ3_MIXED_ALL(q4_k_q6_k, TY_Q4_K, TY_Q6_KP, 2)
KQ3_MIXED_ALL(q5_k_q6_k, TY_Q5_K, TY_Q6_KP, 2)
KQ3_MIXED_ALL(q3_k_q4_k, TY_Q3_KP, TY_Q4_K, 2)
KQ3_MIXED_ALL(q3_k_q5_k, TY_Q3_KP, TY_Q5_K, 2)
KQ3_MIXED_ALL(iq4_xs_q5_k, TY_IQ4_XSP, TY_Q5_K, 4)

// In-place packing of a group of 8 blocks (WORDS u16 words) per block of threads: the group
// is copied to shared memory, then word i of the packed group is written from word
// M::from(i) of the GGUF one. Launch: blockDim.x = 128, any grid (grid-stride over groups);
// w 16-byte aligned.
template <int WORDS, class M>
__device__ void pack_groups_u16(u8* w, u64 n_groups) {
    __shared__ u16 group[WORDS];
    for (u64 gi = blockIdx.x; gi < n_groups; gi += gridDim.x) {
        u16* p = (u16*)(w + gi * (2 * WORDS));
        for (int i = threadIdx.x; i < WORDS; i += blockDim.x) group[i] = p[i];
        __syncthreads();
        for (int i = threadIdx.x; i < WORDS; i += blockDim.x) p[i] = group[M::from(i)];
        __syncthreads();
    }
}

// Q6_K (210-byte blocks, 105 words): words 0..8 are block i's d (its bytes 208..210), then
// the 104 other words of each block.
struct Q6kPacking {
    __device__ static int from(int i) {
        return i < 8 ? 105 * i + 104 : 105 * ((i - 8) / 104) + (i - 8) % 104;
    }
};

// Q3_K (110-byte blocks: hmask 32, qs 64, scales 12, d 2; 55 words): the 8 d, the 8 scale
// sets (12 bytes each), the 8 hmasks (32), then the 8 qs (64).
struct Q3kPacking {
    __device__ static int from(int i) {
        if (i < 8) return 55 * i + 54;
        if (i < 56) return 55 * ((i - 8) / 6) + 48 + (i - 8) % 6;
        if (i < 184) return 55 * ((i - 56) / 16) + (i - 56) % 16;
        return 55 * ((i - 184) / 32) + 16 + (i - 184) % 32;
    }
};

// IQ4_XS (136-byte blocks: an 8-byte header, then 128 bytes of qs; 68 words): the 8
// headers, then the 8 qs.
struct Iq4xsPacking {
    __device__ static int from(int i) {
        return i < 32 ? 68 * (i / 4) + i % 4 : 68 * ((i - 32) / 64) + 4 + (i - 32) % 64;
    }
};

extern "C" __global__ void __launch_bounds__(128) pack_q6_k(u8* w, u64 n_groups) {
    PDL_ENTRY();
    pack_groups_u16<840, Q6kPacking>(w, n_groups);
}

extern "C" __global__ void __launch_bounds__(128) pack_q3_k(u8* w, u64 n_groups) {
    PDL_ENTRY();
    pack_groups_u16<440, Q3kPacking>(w, n_groups);
}

extern "C" __global__ void __launch_bounds__(128) pack_iq4_xs(u8* w, u64 n_groups) {
    PDL_ENTRY();
    pack_groups_u16<544, Iq4xsPacking>(w, n_groups);
}

// Mixture-of-experts products (common.cuh's moe_swiglu / moe_down) of each K-quant layout.
MOE_ENTRIES(moek, q4_k, KqRows<TY_Q4_K>, KQ_R, 1, 2)
MOE_ENTRIES(moek, q5_k, KqRows<TY_Q5_K>, KQ_R, 1, 2)
MOE_ENTRIES(moek, q6_k, KqRows<TY_Q6_KP>, KQ_R, 1, 2)
MOE_ENTRIES(moek, q6_k_gguf, KqRows<TY_Q6_K>, KQ_R, 1, 2)
MOE_ENTRIES(moek, iq4_xs, KqRows<TY_IQ4_XSP>, KQ_R, 1, 2)
MOE_ENTRIES(moek, q3_k, KqRows<TY_Q3_KP>, KQ_R, 1, 2)
