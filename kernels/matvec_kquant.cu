// Decode products over K-quant weights — Q4_K, Q5_K (GGUF layout) and Q6_K (packed layout,
// below) — with activations in 8-bit blocks of 32 (values xq [nt][cols], (scale,
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
//                is values 16s..16s+16 of quarter kk, run B of quarter kk + 2.
//
// Q6_K's 210-byte blocks allow only 2-byte loads, so pack_q6_k rewrites each group of 8
// blocks of a row (1680 bytes) in place: the 8 f16 scales d first (16 bytes), then each
// block's other 208 bytes (ql, qh, scales), 16-byte aligned. Rows hold a multiple of 2048
// values (whole groups; checked on the host). TY_Q6_KP in common.cuh names this layout.
//
// Launch shape (every matveck entry): blockDim.x = 32 * KQ_WARPS, each warp takes KQ_R
// consecutive output rows, gridDim.x = ceil(rows / (KQ_WARPS * KQ_R)). Args as the packed
// kernels': (w, rows, cols, xq, xds, n, out, accum), n <= NT (1, 2, 4, 8); cols a multiple
// of 256 (2048 for Q6_K), w and every row 16-byte aligned.
#define KQ_WARPS 4
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

template <int TY>
__device__ __forceinline__ void kq_load(const u8* row, int b, int c, KqChunk& k) {
    if (TY == TY_Q6_KP) {
        const u8* g = row + (size_t)(b >> 3) * 1680;
        const u8* body = g + 16 + 208 * (b & 7);
        int hh = c >> 2, s = c & 1;
        k.d = h2f(ld16(g + 2 * (b & 7)));
        k.head = ld_stream(body + 192);
        k.q = ld_stream(body + 16 * c);
        k.hi = ld_stream(body + 128 + 32 * hh + 16 * s);
    } else {
        const bool five = TY == TY_Q5_K;
        const u8* blk = row + (size_t)b * (five ? 176 : 144);
        k.head = ld_stream(blk);
        k.q = ld_stream(blk + (five ? 48 : 16) + 16 * c);
        k.hi = five ? ld_stream(blk + 16 + 16 * (c & 1)) : make_uint4(0, 0, 0, 0);
        k.d = 0.f;
    }
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
    if (TY == TY_Q6_KP) {
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
    if (TY == TY_Q6_KP) {
        int hh = c >> 2, kk = (c >> 1) & 1, s = c & 1;
        *blk32 = 4 * hh + kk;
        return 128 * hh + 32 * kk + 16 * s;
    }
    int g = c >> 1, h = c & 1;
    *blk32 = 2 * g;
    return 64 * g + 16 * h;
}

template <int TY>
__device__ __forceinline__ float kq_dot(const KqRuns& r, int4 xa, int4 xb, float2 sa, float2 sb) {
    int da, db;
    if (TY == TY_Q6_KP) {
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
    const int b_off = TY == TY_Q6_KP ? 64 : 32, b_blk = TY == TY_Q6_KP ? 2 : 1;
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

template <int TY, int NT, int R, int U>
__device__ void kq_matvec(const u8* w, int rows, int cols, const i8* xq, const float2* xds,
                          int nt, float* out, int accum) {
    pdl_trigger();
    int lane = threadIdx.x & 31;
    int r0 = (blockIdx.x * KQ_WARPS + (threadIdx.x >> 5)) * R;
    int nrows = min(R, rows - r0);
    if (nrows <= 0) {
        pdl_wait();
        return;
    }
    size_t row_bytes = (size_t)(cols / 256) * (TY == TY_Q6_KP ? 210 : TY == TY_Q5_K ? 176 : 144);
    float acc[R][NT];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int t = 0; t < NT; t++) acc[r][t] = 0.f;
    bool waited = false;
    const u8* rowp[R];
#pragma unroll
    for (int r = 0; r < R; r++) rowp[r] = w + (size_t)(r0 + min(r, nrows - 1)) * row_bytes;
    kq_rows<TY, NT, R, U>(rowp, cols, xq, xds, nt, lane, waited, acc);
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int t = 0; t < NT; t++) {
            float v = warp_sum(acc[r][t]);
            if (lane == r && r < nrows && t < nt) {
                float* o = out + (size_t)t * rows + r0 + r;
                *o = accum ? *o + v : v;
            }
        }
}

#define KQ_ENTRY(name, TY, U, nt)                                                               \
    extern "C" __global__ void __launch_bounds__(32 * KQ_WARPS) matveck_##name##_##nt(           \
        const u8* w, int rows, int cols, const i8* xq, const float2* xds, int n, float* out,     \
        int accum) {                                                                             \
        kq_matvec<TY, nt, KQ_R, U>(w, rows, cols, xq, xds, n, out, accum);                       \
    }

#define KQ_ALL(name, TY, U) KQ_ENTRY(name, TY, U, 1) KQ_ENTRY(name, TY, U, 2) KQ_ENTRY(name, TY, U, 4) KQ_ENTRY(name, TY, U, 8)

KQ_ALL(q4_k, TY_Q4_K, 2)
KQ_ALL(q5_k, TY_Q5_K, 2)
KQ_ALL(q6_k, TY_Q6_KP, 2)

// In-place packing of Q6_K rows (see the top of this file). One block of threads per group
// of 8 GGUF blocks (1680 bytes, 840 u16): the group is copied to shared memory, then written
// back in the packed order. Launch: blockDim.x = 128, any grid (grid-stride over groups);
// w 16-byte aligned.
extern "C" __global__ void __launch_bounds__(128) pack_q6_k(u8* w, u64 n_groups) {
    PDL_ENTRY();
    __shared__ u16 group[840];
    for (u64 gi = blockIdx.x; gi < n_groups; gi += gridDim.x) {
        u16* p = (u16*)(w + gi * 1680);
        for (int i = threadIdx.x; i < 840; i += blockDim.x) group[i] = p[i];
        __syncthreads();
        for (int i = threadIdx.x; i < 840; i += blockDim.x) {
            // Words 0..8: block i's d (its bytes 208..210); then 104 words of each block.
            int from = i < 8 ? 105 * i + 104 : 105 * ((i - 8) / 104) + (i - 8) % 104;
            p[i] = group[from];
        }
        __syncthreads();
    }
}
