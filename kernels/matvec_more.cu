// Matrix-vector products with f32 activations for the weight types matvec.cu does not
// cover: Q4_1, Q5_0, Q5_1, Q8_1, Q2_K, Q3_K, Q8_K, IQ4_NL and IQ4_XS. The contract is
// matvec.cu's: out[t][r] = sum_c w[r][c] * x[t][c] (or out[t][r] += that when accum is
// non-zero) for t < nt <= NT tokens (NT is 1, 2, 4 or 8; the host splits larger batches).
//
// Launch shape (every entry point): blockDim.x = 128 (4 warps), one warp per weight row,
// gridDim.x = ceil(rows / 4). `x` is nt rows of `cols` f32, `out` nt rows of `rows` f32.
// Assumes: w starts 4-byte aligned (cuMemAlloc gives 256), x starts 16-byte aligned, cols
// is a whole number of the type's blocks (checked on the host). Blocks whose size is not a
// multiple of 4 (Q5_0, Q3_K, IQ4_NL) are read in 2-byte loads.
// Each lane decodes a run of consecutive quant bytes of a block at once, so a warp step
// reads consecutive weight bytes and consecutive x values (coalesced); the warp sums its
// lanes at the end. Each value is what the cpu dequantizer gives; only the order of the
// sums differs.

#define MVX_WARPS 4

template <int NT>
__device__ __forceinline__ void mvx_store(float (&acc)[NT], float* out, int rows, int r, int nt,
                                          int accum) {
#pragma unroll
    for (int t = 0; t < NT; t++) {
        float v = warp_sum(acc[t]);
        if ((threadIdx.x & 31) == 0 && t < nt) {
            float* o = out + (size_t)t * rows + r;
            *o = accum ? *o + v : v;
        }
    }
}

#define MVX_PROLOGUE                                             \
    int lane = threadIdx.x & 31;                                 \
    int r = blockIdx.x * MVX_WARPS + (threadIdx.x >> 5);         \
    if (r >= rows) return;                                       \
    float acc[NT];                                               \
    _Pragma("unroll") for (int t = 0; t < NT; t++) acc[t] = 0.f;

__device__ __forceinline__ float dot4(const float (&q)[4], float4 a) {
    return q[0] * a.x + q[1] * a.y + q[2] * a.z + q[3] * a.w;
}

__device__ __forceinline__ float sum4(float4 a) { return a.x + a.y + a.z + a.w; }

// 4 bytes at a 2-byte aligned address, little-endian.
__device__ __forceinline__ u32 ld32_2(const u8* p) {
    return (u32)ld16(p) | ((u32)ld16(p + 2) << 16);
}

// The 32-blocks with 16 bytes of nibbles (Q4_1, Q5_0, Q5_1, IQ4_NL): four lanes per block
// (sub = lane & 3), each taking quant bytes 4 sub..4 sub+3: elements 4 sub + i (low
// nibbles) and 16 + 4 sub + i (high nibbles), so a warp reads 8 consecutive blocks per step.
template <int NT, int TY>
__device__ void mv_nibbles32(const u8* w, int rows, int cols, const float* x, int nt, float* out,
                             int accum) {
    MVX_PROLOGUE
    const bool five = TY == TY_Q5_0 || TY == TY_Q5_1;
    const bool has_min = TY == TY_Q4_1 || TY == TY_Q5_1;
    const int bb = TY == TY_Q4_1 ? 20 : TY == TY_Q5_0 ? 22 : TY == TY_Q5_1 ? 24 : 18;
    // Where the 16 quant bytes start; Q5's 32 fifth bits are the 4 bytes before them.
    const int qo = TY == TY_Q4_1 ? 4 : TY == TY_Q5_0 ? 6 : TY == TY_Q5_1 ? 8 : 2;
    int nb = cols / 32, sub = lane & 3;
    const u8* row = w + (size_t)r * nb * bb;
#pragma unroll 4
    for (int b = lane >> 2; b < nb; b += 8) {
        const u8* blk = row + (size_t)b * bb;
        float d = h2f(ld16(blk));
        float m = has_min ? h2f(ld16(blk + 2)) : 0.f;
        u32 qs = ld32_2(blk + qo + 4 * sub);
        u32 qh = five ? ld32_2(blk + qo - 4) : 0;
        float lo[4], hi[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int byte = (qs >> (8 * i)) & 255;
            int l = byte & 15, h = byte >> 4;
            if (five) {
                l |= ((qh >> (4 * sub + i)) & 1) << 4;
                h |= ((qh >> (16 + 4 * sub + i)) & 1) << 4;
            }
            if (TY == TY_IQ4_NL) {
                lo[i] = iq4_value(l);
                hi[i] = iq4_value(h);
            } else if (TY == TY_Q5_0) {
                lo[i] = (float)(l - 16);
                hi[i] = (float)(h - 16);
            } else {
                lo[i] = (float)l;
                hi[i] = (float)h;
            }
        }
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t < nt) {
                const float* xs = x + (size_t)t * cols + b * 32 + 4 * sub;
                float4 a = *(const float4*)xs, c = *(const float4*)(xs + 16);
                float s = d * (dot4(lo, a) + dot4(hi, c));
                acc[t] += has_min ? s + m * (sum4(a) + sum4(c)) : s;
            }
        }
    }
    mvx_store<NT>(acc, out, rows, r, nt, accum);
}

// Q8_1 ({f16 d, f16 s, 32 i8}; s unused): four lanes per block, 8 quants each.
template <int NT>
__device__ void mv_q8_1(const u8* w, int rows, int cols, const float* x, int nt, float* out,
                        int accum) {
    MVX_PROLOGUE
    int nb = cols / 32, sub = lane & 3;
    const u8* row = w + (size_t)r * nb * 36;
#pragma unroll 4
    for (int b = lane >> 2; b < nb; b += 8) {
        const u8* blk = row + (size_t)b * 36;
        float d = h2f(ld16(blk));
        u32 q0 = *(const u32*)(blk + 4 + 8 * sub), q1 = *(const u32*)(blk + 8 + 8 * sub);
        float lo[4], hi[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            lo[i] = (float)(i8)((q0 >> (8 * i)) & 255);
            hi[i] = (float)(i8)((q1 >> (8 * i)) & 255);
        }
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t < nt) {
                const float* xs = x + (size_t)t * cols + b * 32 + 8 * sub;
                float4 a = *(const float4*)xs, c = *(const float4*)(xs + 4);
                acc[t] += d * (dot4(lo, a) + dot4(hi, c));
            }
        }
    }
    mvx_store<NT>(acc, out, rows, r, nt, accum);
}

// Q8_K ({f32 d, 256 i8, 16 i16 sums}; the sums unused): one block per warp step, lane l
// takes quants 8 l..8 l+7.
template <int NT>
__device__ void mv_q8_k(const u8* w, int rows, int cols, const float* x, int nt, float* out,
                        int accum) {
    MVX_PROLOGUE
    int nb = cols / 256;
    const u8* row = w + (size_t)r * nb * 292;
#pragma unroll 2
    for (int b = 0; b < nb; b++) {
        const u8* blk = row + (size_t)b * 292;
        float d = *(const float*)blk;
        u32 q0 = *(const u32*)(blk + 4 + 8 * lane), q1 = *(const u32*)(blk + 8 + 8 * lane);
        float lo[4], hi[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            lo[i] = (float)(i8)((q0 >> (8 * i)) & 255);
            hi[i] = (float)(i8)((q1 >> (8 * i)) & 255);
        }
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t < nt) {
                const float* xs = x + (size_t)t * cols + b * 256 + 8 * lane;
                float4 a = *(const float4*)xs, c = *(const float4*)(xs + 4);
                acc[t] += d * (dot4(lo, a) + dot4(hi, c));
            }
        }
    }
    mvx_store<NT>(acc, out, rows, r, nt, accum);
}

// Q2_K and Q3_K: 16 lanes per 256-block (two blocks per warp step); lane (h, c) =
// ((lane >> 3) & 1, lane & 7) takes quant bytes 4c..4c+3 of half h, whose bits 2j..2j+1
// are elements 128h + 32j + 4c + i (j, i < 4): 16 values, 4 in each of 4 sub-blocks of 16
// (sub-block 8h + 2j + c / 4).
template <int NT, bool THREE>
__device__ void mv_q23_k(const u8* w, int rows, int cols, const float* x, int nt, float* out,
                         int accum) {
    MVX_PROLOGUE
    const int bb = THREE ? 110 : 84;
    int nb = cols / 256, h = (lane >> 3) & 1, c = lane & 7;
    const u8* row = w + (size_t)r * nb * bb;
#pragma unroll 2
    for (int b = lane >> 4; b < nb; b += 2) {
        const u8* blk = row + (size_t)b * bb;
        float dl[4], ml[4], q[4][4];
        if (THREE) {
            // {hmask[32], qs[64], scales[12], f16 d}: a clear bit 4h + j of hmask[4c + i]
            // lowers the value by 4.
            float d = h2f(ld16(blk + 108));
            u32 qs = ld32_2(blk + 32 + 32 * h + 4 * c);
            u32 hm = ld32_2(blk + 4 * c);
#pragma unroll
            for (int j = 0; j < 4; j++) {
                dl[j] = d * (float)scale_q3_k(8 * h + 2 * j + (c >> 2), blk + 96);
                ml[j] = 0.f;
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    int v = (qs >> (8 * i + 2 * j)) & 3;
                    q[j][i] = (float)((hm >> (8 * i + 4 * h + j)) & 1 ? v : v - 4);
                }
            }
        } else {
            // {scales[16] (scale low nibble, min high), qs[64], f16 d, f16 dmin}.
            float d = h2f(ld16(blk + 80)), dmin = h2f(ld16(blk + 82));
            u32 qs = *(const u32*)(blk + 16 + 32 * h + 4 * c);
#pragma unroll
            for (int j = 0; j < 4; j++) {
                int sc = blk[8 * h + 2 * j + (c >> 2)];
                dl[j] = d * (float)(sc & 15);
                ml[j] = dmin * (float)(sc >> 4);
#pragma unroll
                for (int i = 0; i < 4; i++) q[j][i] = (float)((qs >> (8 * i + 2 * j)) & 3);
            }
        }
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t < nt) {
                const float* xs = x + (size_t)t * cols + b * 256 + 128 * h + 4 * c;
                float s = 0.f;
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    float4 v = *(const float4*)(xs + 32 * j);
                    s += dl[j] * dot4(q[j], v);
                    if (!THREE) s -= ml[j] * sum4(v);
                }
                acc[t] += s;
            }
        }
    }
    mvx_store<NT>(acc, out, rows, r, nt, accum);
}

// IQ4_XS ({f16 d, u16 scales_h, scales_l[4], qs[128]}): one block per warp step; lane
// (ib, sub) = (lane / 4, lane % 4) takes bytes 4 sub..4 sub+3 of sub-block ib's 16:
// elements 32 ib + 4 sub + i (low nibbles) and 32 ib + 16 + 4 sub + i (high).
template <int NT>
__device__ void mv_iq4_xs(const u8* w, int rows, int cols, const float* x, int nt, float* out,
                          int accum) {
    MVX_PROLOGUE
    int nb = cols / 256, ib = lane >> 2, sub = lane & 3;
    const u8* row = w + (size_t)r * nb * 136;
#pragma unroll 2
    for (int b = 0; b < nb; b++) {
        const u8* blk = row + (size_t)b * 136;
        float dl = h2f(ld16(blk)) * (float)scale_iq4_xs(ib, blk);
        u32 qs = *(const u32*)(blk + 8 + 16 * ib + 4 * sub);
        float lo[4], hi[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int byte = (qs >> (8 * i)) & 255;
            lo[i] = iq4_value(byte & 15);
            hi[i] = iq4_value(byte >> 4);
        }
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t < nt) {
                const float* xs = x + (size_t)t * cols + b * 256 + 32 * ib + 4 * sub;
                float4 a = *(const float4*)xs, c = *(const float4*)(xs + 16);
                acc[t] += dl * (dot4(lo, a) + dot4(hi, c));
            }
        }
    }
    mvx_store<NT>(acc, out, rows, r, nt, accum);
}

#define MVX_ARGS const u8 *w, int rows, int cols, const float *x, int nt, float *out, int accum
#define MVX_PASS w, rows, cols, x, nt, out, accum

template <int NT> __device__ void mv_q4_1(MVX_ARGS) { mv_nibbles32<NT, TY_Q4_1>(MVX_PASS); }
template <int NT> __device__ void mv_q5_0(MVX_ARGS) { mv_nibbles32<NT, TY_Q5_0>(MVX_PASS); }
template <int NT> __device__ void mv_q5_1(MVX_ARGS) { mv_nibbles32<NT, TY_Q5_1>(MVX_PASS); }
template <int NT> __device__ void mv_iq4_nl(MVX_ARGS) { mv_nibbles32<NT, TY_IQ4_NL>(MVX_PASS); }
template <int NT> __device__ void mv_q2_k(MVX_ARGS) { mv_q23_k<NT, false>(MVX_PASS); }
template <int NT> __device__ void mv_q3_k(MVX_ARGS) { mv_q23_k<NT, true>(MVX_PASS); }

#define MV_ENTRY(name, nt)                                                                   \
    extern "C" __global__ void __launch_bounds__(128)                                         \
        matvec_##name##_##nt(const u8* w, int rows, int cols, const float* x, int n,         \
                             float* out, int accum) {                                         \
        PDL_ENTRY();                                                                          \
        mv_##name<nt>(w, rows, cols, x, n, out, accum);                                       \
    }

#define MV_ALL(name) MV_ENTRY(name, 1) MV_ENTRY(name, 2) MV_ENTRY(name, 4) MV_ENTRY(name, 8)

MV_ALL(q4_1)
MV_ALL(q5_0)
MV_ALL(q5_1)
MV_ALL(q8_1)
MV_ALL(q2_k)
MV_ALL(q3_k)
MV_ALL(q8_k)
MV_ALL(iq4_nl)
MV_ALL(iq4_xs)
