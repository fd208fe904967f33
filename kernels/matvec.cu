// Matrix-vector products straight from quantized weights: out[t][r] = sum_c w[r][c] * x[t][c]
// (or out[t][r] += that when accum is non-zero: the residual add fused into the product)
// for t < nt <= NT tokens (NT is 1, 2, 4 or 8; the host splits larger batches).
//
// Launch shape (every entry point): blockDim.x = 128 (4 warps), one warp per weight row,
// gridDim.x = ceil(rows / 4). `x` is nt rows of `cols` f32, `out` nt rows of `rows` f32.
// Assumes: w starts 16-byte aligned (cuMemAlloc gives 256), x starts 16-byte aligned,
// cols is a whole number of the type's blocks (checked on the host).
// Lanes split each block so that a warp reads consecutive weight bytes and consecutive x
// values in each step (coalesced); the warp sums its lanes at the end.

#define MV_WARPS 4

template <int NT>
__device__ __forceinline__ void mv_store(float (&acc)[NT], float* out, int rows, int r, int nt, int accum) {
#pragma unroll
    for (int t = 0; t < NT; t++) {
        float v = warp_sum(acc[t]);
        if ((threadIdx.x & 31) == 0 && t < nt) {
            float* o = out + (size_t)t * rows + r;
            *o = accum ? *o + v : v;
        }
    }
}

#define MV_PROLOGUE                                              \
    int lane = threadIdx.x & 31;                                 \
    int r = blockIdx.x * MV_WARPS + (threadIdx.x >> 5);          \
    if (r >= rows) return;                                       \
    float acc[NT];                                               \
    _Pragma("unroll") for (int t = 0; t < NT; t++) acc[t] = 0.f;

// Q4_0: four lanes per 32-block, each taking 4 bytes (4 low and 4 high nibbles), so a warp
// reads 8 consecutive blocks and 1 KiB of consecutive x per step (coalesced).
template <int NT>
__device__ void mv_q4_0(const u8* w, int rows, int cols, const float* x, int nt, float* out, int accum) {
    MV_PROLOGUE
    int nb = cols / 32, sub = lane & 3;
    const u8* row = w + (size_t)r * nb * 18;
#pragma unroll 4
    for (int b = lane >> 2; b < nb; b += 8) {
        const u8* blk = row + b * 18;
        float d = h2f(ld16(blk));
        u32 qs = (u32)ld16(blk + 2 + 4 * sub) | ((u32)ld16(blk + 4 + 4 * sub) << 16);
        float lo[4], hi[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int byte = (qs >> (8 * i)) & 255;
            lo[i] = (float)((byte & 15) - 8);
            hi[i] = (float)((byte >> 4) - 8);
        }
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t < nt) {
                const float* xs = x + (size_t)t * cols + b * 32 + 4 * sub;
                float4 a = *(const float4*)xs, c = *(const float4*)(xs + 16);
                acc[t] += d * (lo[0] * a.x + lo[1] * a.y + lo[2] * a.z + lo[3] * a.w +
                               hi[0] * c.x + hi[1] * c.y + hi[2] * c.z + hi[3] * c.w);
            }
        }
    }
    mv_store<NT>(acc, out, rows, r, nt, accum);
}

// Q8_0: four lanes per 32-block, 8 quants each.
template <int NT>
__device__ void mv_q8_0(const u8* w, int rows, int cols, const float* x, int nt, float* out, int accum) {
    MV_PROLOGUE
    int nb = cols / 32, sub = lane & 3;
    const u8* row = w + (size_t)r * nb * 34;
#pragma unroll 4
    for (int b = lane >> 2; b < nb; b += 8) {
        const u8* blk = row + b * 34;
        float d = h2f(ld16(blk));
        float q[8];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            u16 v = ld16(blk + 2 + 8 * sub + 2 * j);
            q[2 * j] = (float)(i8)(v & 255);
            q[2 * j + 1] = (float)(i8)(v >> 8);
        }
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t < nt) {
                const float* xs = x + (size_t)t * cols + b * 32 + 8 * sub;
                float4 a = *(const float4*)xs, c = *(const float4*)(xs + 4);
                acc[t] += d * (q[0] * a.x + q[1] * a.y + q[2] * a.z + q[3] * a.w +
                               q[4] * c.x + q[5] * c.y + q[6] * c.z + q[7] * c.w);
            }
        }
    }
    mv_store<NT>(acc, out, rows, r, nt, accum);
}

// Q4_K and Q5_K: the warp takes one 256-block per step; lane (g, c) = (lane / 8, lane % 8)
// takes bytes 4c..4c+3 of group g: 4 values of sub-block 2g (low nibbles) and 4 of 2g+1.
template <int NT, bool FIVE>
__device__ void mv_q45_k(const u8* w, int rows, int cols, const float* x, int nt, float* out, int accum) {
    MV_PROLOGUE
    const int bb = FIVE ? 176 : 144;
    int nb = cols / 256, g = lane >> 3, l0 = 4 * (lane & 7);
    const u8* row = w + (size_t)r * nb * bb;
#pragma unroll 4
    for (int b = 0; b < nb; b++) {
        const u8* blk = row + (size_t)b * bb;
        float d = h2f(ld16(blk)), dmin = h2f(ld16(blk + 2));
        int sc1, m1, sc2, m2;
        scale_min_k4(2 * g, blk + 4, &sc1, &m1);
        scale_min_k4(2 * g + 1, blk + 4, &sc2, &m2);
        u32 qs = *(const u32*)(blk + (FIVE ? 48 : 16) + 32 * g + l0);
        u32 qh = FIVE ? *(const u32*)(blk + 16 + l0) : 0;
        float lo[4], hi[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int byte = (qs >> (8 * i)) & 255;
            int hb = (qh >> (8 * i)) & 255;
            lo[i] = (float)((byte & 15) | (FIVE ? ((hb >> (2 * g)) & 1) << 4 : 0));
            hi[i] = (float)((byte >> 4) | (FIVE ? ((hb >> (2 * g + 1)) & 1) << 4 : 0));
        }
        float d1 = d * (float)sc1, d2 = d * (float)sc2;
        float n1 = dmin * (float)m1, n2 = dmin * (float)m2;
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t < nt) {
                const float* xs = x + (size_t)t * cols + b * 256 + 64 * g + l0;
                float4 a = *(const float4*)xs, c = *(const float4*)(xs + 32);
                float qa = lo[0] * a.x + lo[1] * a.y + lo[2] * a.z + lo[3] * a.w;
                float qc = hi[0] * c.x + hi[1] * c.y + hi[2] * c.z + hi[3] * c.w;
                acc[t] += d1 * qa - n1 * (a.x + a.y + a.z + a.w) + d2 * qc - n2 * (c.x + c.y + c.z + c.w);
            }
        }
    }
    mv_store<NT>(acc, out, rows, r, nt, accum);
}

// Q6_K: 16 lanes per 256-block (two blocks per warp step); lane (h, c) takes bytes
// 4c..4c+3 of half h: 16 values, 4 from each of its quarters k.
template <int NT>
__device__ void mv_q6_k(const u8* w, int rows, int cols, const float* x, int nt, float* out, int accum) {
    MV_PROLOGUE
    int nb = cols / 256, h = (lane >> 3) & 1, c = lane & 7, l0 = 4 * c;
    const u8* row = w + (size_t)r * nb * 210;
#pragma unroll 4
    for (int b = lane >> 4; b < nb; b += 2) {
        const u8* blk = row + (size_t)b * 210;
        float d = h2f(ld16(blk + 208));
        const u8* ql = blk + 64 * h + l0;
        const u8* qh = blk + 128 + 32 * h + l0;
        u32 A = (u32)ld16(ql) | ((u32)ld16(ql + 2) << 16);
        u32 B = (u32)ld16(ql + 32) | ((u32)ld16(ql + 34) << 16);
        u32 H = (u32)ld16(qh) | ((u32)ld16(qh + 2) << 16);
        float q[4][4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int a = (A >> (8 * i)) & 255, bq = (B >> (8 * i)) & 255, hb = (H >> (8 * i)) & 255;
            q[0][i] = (float)(((a & 15) | ((hb & 3) << 4)) - 32);
            q[1][i] = (float)(((bq & 15) | (((hb >> 2) & 3) << 4)) - 32);
            q[2][i] = (float)(((a >> 4) | (((hb >> 4) & 3) << 4)) - 32);
            q[3][i] = (float)(((bq >> 4) | (((hb >> 6) & 3) << 4)) - 32);
        }
        float sc[4];
#pragma unroll
        for (int k = 0; k < 4; k++) sc[k] = d * (float)(i8)blk[192 + 8 * h + (c >> 2) + 2 * k];
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t < nt) {
                const float* xs = x + (size_t)t * cols + b * 256 + 128 * h + l0;
                float s = 0.f;
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    float4 v = *(const float4*)(xs + 32 * k);
                    s += sc[k] * (q[k][0] * v.x + q[k][1] * v.y + q[k][2] * v.z + q[k][3] * v.w);
                }
                acc[t] += s;
            }
        }
    }
    mv_store<NT>(acc, out, rows, r, nt, accum);
}

// F16 / BF16: 8 elements per lane step when cols % 8 == 0 (16-byte loads), else one.
template <int NT, bool BF>
__device__ void mv_half(const u8* w, int rows, int cols, const float* x, int nt, float* out, int accum) {
    MV_PROLOGUE
    const u16* row = (const u16*)w + (size_t)r * cols;
    if ((cols & 7) == 0) {
        for (int c = lane * 8; c < cols; c += 256) {
            uint4 raw = *(const uint4*)(row + c);
            u32 ws[4] = {raw.x, raw.y, raw.z, raw.w};
            float wv[8];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                u16 lo = ws[i] & 0xffff, hi = ws[i] >> 16;
                wv[2 * i] = BF ? bf2f(lo) : h2f(lo);
                wv[2 * i + 1] = BF ? bf2f(hi) : h2f(hi);
            }
#pragma unroll
            for (int t = 0; t < NT; t++) {
                if (t < nt) {
                    const float4* xv = (const float4*)(x + (size_t)t * cols + c);
                    float4 a = xv[0], b = xv[1];
                    acc[t] += wv[0] * a.x + wv[1] * a.y + wv[2] * a.z + wv[3] * a.w +
                              wv[4] * b.x + wv[5] * b.y + wv[6] * b.z + wv[7] * b.w;
                }
            }
        }
    } else {
        for (int c = lane; c < cols; c += 32) {
            float wv = BF ? bf2f(row[c]) : h2f(row[c]);
#pragma unroll
            for (int t = 0; t < NT; t++)
                if (t < nt) acc[t] += wv * x[(size_t)t * cols + c];
        }
    }
    mv_store<NT>(acc, out, rows, r, nt, accum);
}

template <int NT>
__device__ void mv_f32(const u8* w, int rows, int cols, const float* x, int nt, float* out, int accum) {
    MV_PROLOGUE
    const float* row = (const float*)w + (size_t)r * cols;
    bool vec = (cols & 3) == 0;
    for (int c = lane * (vec ? 4 : 1); c < cols; c += vec ? 128 : 32) {
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t < nt) {
                const float* xr = x + (size_t)t * cols + c;
                if (vec) {
                    float4 a = *(const float4*)(row + c), b = *(const float4*)xr;
                    acc[t] += a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
                } else {
                    acc[t] += row[c] * xr[0];
                }
            }
        }
    }
    mv_store<NT>(acc, out, rows, r, nt, accum);
}

template <int NT> __device__ void mv_q4_k(const u8* w, int rows, int cols, const float* x, int nt, float* out, int accum) { mv_q45_k<NT, false>(w, rows, cols, x, nt, out, accum); }
template <int NT> __device__ void mv_q5_k(const u8* w, int rows, int cols, const float* x, int nt, float* out, int accum) { mv_q45_k<NT, true>(w, rows, cols, x, nt, out, accum); }
template <int NT> __device__ void mv_f16(const u8* w, int rows, int cols, const float* x, int nt, float* out, int accum) { mv_half<NT, false>(w, rows, cols, x, nt, out, accum); }
template <int NT> __device__ void mv_bf16(const u8* w, int rows, int cols, const float* x, int nt, float* out, int accum) { mv_half<NT, true>(w, rows, cols, x, nt, out, accum); }

#define MV_ENTRY(name, nt)                                                                    \
    extern "C" __global__ void __launch_bounds__(128)                                         \
        matvec_##name##_##nt(const u8* w, int rows, int cols, const float* x, int n, float* out, \
                             int accum) { PDL_ENTRY();                                                 \
        mv_##name<nt>(w, rows, cols, x, n, out, accum);                                            \
    }

#define MV_ALL(name) MV_ENTRY(name, 1) MV_ENTRY(name, 2) MV_ENTRY(name, 4) MV_ENTRY(name, 8)

MV_ALL(f32)
MV_ALL(f16)
MV_ALL(bf16)
MV_ALL(q4_0)
MV_ALL(q8_0)
MV_ALL(q4_k)
MV_ALL(q5_k)
MV_ALL(q6_k)

// ---- 8-bit activations (Q4_0 weights) ----
// quantize_q8: one warp per 32 values of x; the same arithmetic as the cpu backend's
// quantize_row_q8 (d = amax / 127, q = round(x / d)), so both backends see equal integers.
// Launch: blockDim.x = 256, one warp per block of 32, n * cols / 32 warps in all.
extern "C" __global__ void __launch_bounds__(256)
    quantize_q8(const float* x, int cols, int nt, i8* xq, float2* xds) {
    PDL_ENTRY();
    int warp = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5), lane = threadIdx.x & 31;
    int nb = cols / 32;
    if (warp >= nt * nb) return;
    int t = warp / nb, b = warp - t * nb;
    size_t at = (size_t)t * cols + (size_t)b * 32 + lane;
    q8_block(x[at], lane, xq + at, xds + (size_t)t * nb + b);
}

// Q4_0 with 8-bit x: four lanes per 32-block as in mv_q4_0; each lane's 8 nibbles meet
// its 8 int8 values in two dp4a, minus 8 times their sum (the nibbles' offset). Adds this
// lane's share of row `row` times each token into acc.
template <int NT>
__device__ __forceinline__ void q4_0_row_x8(const u8* row, int cols, const i8* xq,
                                            const float2* xds, int nt, int lane,
                                            float (&acc)[NT]) {
    int nb = cols / 32, sub = lane & 3;
#pragma unroll 4
    for (int b = lane >> 2; b < nb; b += 8) {
        const u8* blk = row + b * 18;
        float d = h2f(ld16(blk));
        u32 qs = (u32)ld16(blk + 2 + 4 * sub) | ((u32)ld16(blk + 4 + 4 * sub) << 16);
        u32 lo = qs & 0x0F0F0F0Fu, hi = (qs >> 4) & 0x0F0F0F0Fu;
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t < nt) {
                const i8* xs = xq + (size_t)t * cols + b * 32 + 4 * sub;
                int xa = *(const int*)xs, xb = *(const int*)(xs + 16);
                int dot = dp4a_us(lo, xa, dp4a_us(hi, xb, 0));
                int sx = dp4a_us(0x01010101u, xa, dp4a_us(0x01010101u, xb, 0));
                acc[t] += d * xds[(size_t)t * nb + b].x * (float)(dot - 8 * sx);
            }
        }
    }
}

template <int NT>
__device__ void mvq_q4_0(const u8* w, int rows, int cols, const i8* xq, const float2* xds,
                         int nt, float* out, int accum) {
    MV_PROLOGUE
    q4_0_row_x8<NT>(w + (size_t)r * (cols / 32) * 18, cols, xq, xds, nt, lane, acc);
    mv_store<NT>(acc, out, rows, r, nt, accum);
}

// The feed-forward gate: out[t][r] = act(gate[r] . x[t]) * (up[r] . x[t]) (gate_act), both rows in
// one warp, so the gate and up products never leave registers.
template <int NT>
__device__ void mvq_swiglu_q4_0(const u8* wg, const u8* wu, int rows, int cols, const i8* xq,
                                const float2* xds, int nt, float* out, int act) {
    MV_PROLOGUE
    float up[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) up[t] = 0.f;
    size_t at = (size_t)r * (cols / 32) * 18;
    q4_0_row_x8<NT>(wg + at, cols, xq, xds, nt, lane, acc);
    q4_0_row_x8<NT>(wu + at, cols, xq, xds, nt, lane, up);
#pragma unroll
    for (int t = 0; t < NT; t++) {
        float g = warp_sum(acc[t]), u = warp_sum(up[t]);
        if (lane == 0 && t < nt) out[(size_t)t * rows + r] = gate_act(g, act) * u;
    }
}

// Three products of one input (q, k, v) in one launch: global row R picks the matrix.
template <int NT>
__device__ void mvq3_q4_0(const u8* w0, const u8* w1, const u8* w2, int r0, int r1, int r2,
                          int cols, const i8* xq, const float2* xds, int nt, float* o0,
                          float* o1, float* o2) {
    int lane = threadIdx.x & 31;
    int R = blockIdx.x * MV_WARPS + (threadIdx.x >> 5);
    const u8* w;
    float* out;
    int rows, r;
    if (R < r0) {
        w = w0, out = o0, rows = r0, r = R;
    } else if (R < r0 + r1) {
        w = w1, out = o1, rows = r1, r = R - r0;
    } else if (R < r0 + r1 + r2) {
        w = w2, out = o2, rows = r2, r = R - r0 - r1;
    } else {
        return;
    }
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = 0.f;
    q4_0_row_x8<NT>(w + (size_t)r * (cols / 32) * 18, cols, xq, xds, nt, lane, acc);
    mv_store<NT>(acc, out, rows, r, nt, 0);
}

#define MVQ3_ENTRY(nt)                                                                        \
    extern "C" __global__ void __launch_bounds__(128) matvecq3_q4_0_##nt(                     \
        const u8* w0, const u8* w1, const u8* w2, int r0, int r1, int r2, int cols,          \
        const i8* xq, const float2* xds, int n, float* o0, float* o1, float* o2) { PDL_ENTRY();           \
        mvq3_q4_0<nt>(w0, w1, w2, r0, r1, r2, cols, xq, xds, n, o0, o1, o2);                  \
    }

MVQ3_ENTRY(1)
MVQ3_ENTRY(2)
MVQ3_ENTRY(4)
MVQ3_ENTRY(8)

#define MVQ_SWIGLU_ENTRY(nt)                                                                  \
    extern "C" __global__ void __launch_bounds__(128) matvecq_swiglu_q4_0_##nt(               \
        const u8* wg, const u8* wu, int rows, int cols, const i8* xq, const float2* xds,     \
        int n, float* out, int act) { PDL_ENTRY();                                                         \
        mvq_swiglu_q4_0<nt>(wg, wu, rows, cols, xq, xds, n, out, act);                        \
    }

MVQ_SWIGLU_ENTRY(1)
MVQ_SWIGLU_ENTRY(2)
MVQ_SWIGLU_ENTRY(4)
MVQ_SWIGLU_ENTRY(8)

#define MVQ_ENTRY(name, nt)                                                                   \
    extern "C" __global__ void __launch_bounds__(128) matvecq_##name##_##nt(                  \
        const u8* w, int rows, int cols, const i8* xq, const float2* xds, int n, float* out,     \
        int accum) { PDL_ENTRY();                                                                          \
        mvq_##name<nt>(w, rows, cols, xq, xds, n, out, accum);                                     \
    }

#define MVQ_ALL(name) MVQ_ENTRY(name, 1) MVQ_ENTRY(name, 2) MVQ_ENTRY(name, 4) MVQ_ENTRY(name, 8)

MVQ_ALL(q4_0)
