// Shared helpers for every tether kernel file. NVRTC compiles each .cu file with this text
// prepended (no #include, so no CUDA toolkit headers are needed at run time).
//
// Type ids are ggml's: F32 0, F16 1, Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q8_0 8, Q8_1 9,
// Q2_K 10, Q3_K 11, Q4_K 12, Q5_K 13, Q6_K 14, Q8_K 15, IQ4_NL 20, IQ4_XS 23, BF16 30.

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define TY_F32 0
#define TY_F16 1
#define TY_Q4_0 2
#define TY_Q4_1 3
#define TY_Q5_0 6
#define TY_Q5_1 7
#define TY_Q8_0 8
#define TY_Q8_1 9
#define TY_Q2_K 10
#define TY_Q3_K 11
#define TY_Q4_K 12
#define TY_Q5_K 13
#define TY_Q6_K 14
#define TY_Q8_K 15
#define TY_IQ4_NL 20
#define TY_IQ4_XS 23
#define TY_BF16 30
// Q4_0 and Q8_0 in the packed layout of matvec_packed.cu (not ggml ids): rows of groups of
// 8 blocks, the group's 8 f16 scales first, then its blocks' quants.
#define TY_Q4_0P 1002
#define TY_Q8_0P 1008
// Q6_K in the packed layout of matvec_kquant.cu: groups of 8 blocks, their 8 f16 scales d
// first, then each block's other 208 bytes.
#define TY_Q6_KP 1014
// Q3_K in the packed layout of matvec_kquant.cu: groups of 8 blocks as 8 d, 8 scale sets,
// 8 hmasks, 8 qs.
#define TY_Q3_KP 1011
// IQ4_XS in the packed layout of matvec_kquant.cu: groups of 8 blocks as 8 headers, 8 qs.
#define TY_IQ4_XSP 1023

#define NEG_INF __int_as_float(0xff800000)

// The cache cell of virtual cell v when each sequence keeps a ring of `ring` cells (0: no
// ring, v is the cell). Sequence s owns virtual cells [2 ring s, 2 ring (s + 1)), so a
// window that wraps round its ring is still one run of consecutive virtual cells.
__device__ __forceinline__ u32 ring_cell(u32 v, u32 ring) {
    if (ring == 0) return v;
    u32 per_seq = 2 * ring;
    return (v / per_seq) * ring + (v % per_seq) % ring;
}

// Cells of one block of a paged cache (KV_BLOCK_CELLS in backend.rs).
#define KV_BLOCK_CELLS 32

// The cache cell of virtual cell v: in a ring (ring > 0, see ring_cell), else through the
// block table of a paged cache (cell v % KV_BLOCK_CELLS of block blocks[v / KV_BLOCK_CELLS]),
// else v itself. A layer's cache is either a ring or paged, never both.
__device__ __forceinline__ u32 kv_cell(u32 v, u32 ring, const u32* blocks) {
    if (ring != 0) return ring_cell(v, ring);
    if (blocks == nullptr) return v;
    return blocks[v / KV_BLOCK_CELLS] * KV_BLOCK_CELLS + v % KV_BLOCK_CELLS;
}

// Programmatic dependent launch (sm_90 and later; no-ops before, and when a kernel was
// launched without it). The host launches decode kernels so that the next kernel's blocks
// may start while this one runs: each kernel first lets its successor launch, then waits
// until its predecessor has finished and its writes are visible, before it reads or writes
// anything another kernel touches. Only constant data (weights) may be read before the wait.
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_trigger() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

#define PDL_ENTRY() \
    do {            \
        pdl_trigger(); \
        pdl_wait();    \
    } while (0)

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// Round to nearest even, like half::f16::from_f32 on the cpu.
// The result goes through a 32-bit register: with a 16-bit asm output, byte extraction
// of the value (dh & 255) was seen to read zeros on sm_90 with NVRTC 13.0.
__device__ __forceinline__ u16 f2h(float f) {
    u32 h;
    asm("{ .reg .b16 t; cvt.rn.f16.f32 t, %1; cvt.u32.u16 %0, t; }" : "=r"(h) : "f"(f));
    return (u16)h;
}

__device__ __forceinline__ float bf2f(u16 h) { return __uint_as_float(((u32)h) << 16); }

// A little-endian u16 at a 2-byte aligned address (every ggml block size is even).
__device__ __forceinline__ u16 ld16(const u8* p) { return *(const u16*)p; }

// 16 bytes of weights that are read once: past L1, which keeps the activations.
__device__ __forceinline__ uint4 ld_stream(const u8* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// The activation of a gated feed-forward, by the `act` argument its kernels take:
// 0: silu(g) = g / (1 + e^-g) (LLaMA, Qwen, Phi-3); 1: GELU with the tanh approximation,
// g/2 * (1 + tanh(sqrt(2/pi) * (g + 0.044715 g^3))) (Gemma).
#define GATE_SILU 0
#define GATE_GELU_TANH 1
__device__ __forceinline__ float gelu_tanh(float g) {
    return 0.5f * g * (1.f + tanhf(0.7978845608f * (g + 0.044715f * g * g * g)));
}
__device__ __forceinline__ float gate_act(float g, int act) {
    return act == GATE_GELU_TANH ? gelu_tanh(g) : g / (1.f + expf(-g));
}

// An attention score soft-capped to cap * tanh(s / cap) (Gemma 2); cap 0: unchanged.
__device__ __forceinline__ float cap_score(float s, float cap) {
    return cap > 0.f ? cap * tanhf(s / cap) : s;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ double warp_sum_d(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Scale and min of sub-block j (0..8) from the 12 packed bytes of a Q4_K/Q5_K block.
__device__ __forceinline__ void scale_min_k4(int j, const u8* q, int* sc, int* m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// Byte (s & 7) of the 8 bytes {y:x} (x the low 4): PTX prmt, a register-only table lookup.
__device__ __forceinline__ u32 byte_of(u32 x, u32 y, int s) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(x), "r"(y), "r"(s & 7));
    return r & 255;
}

// IQ4's 16 non-uniform levels (signed bytes), 4 to a word, for byte_perm lookups.
#define IQ4_LEVELS_0 0xBFAD9881u  // -127 -104 -83 -65
#define IQ4_LEVELS_1 0xF6EADDCFu  //  -49  -35 -22 -10
#define IQ4_LEVELS_2 0x26190D01u  //    1   13  25  38
#define IQ4_LEVELS_3 0x71594535u  //   53   69  89 113

// The IQ4 levels of the 8 nibbles of q: lo gets the low nibbles' (bytes 0..3 in order),
// hi the high ones', as signed bytes. Each byte_perm looks up four nibbles by their low 3
// bits in the levels of 0..7 and of 8..15; bit 3 picks between the two, and the values are
// then split into even and odd nibbles.
__device__ __forceinline__ void iq4_values(u32 q, int* lo, int* hi) {
    // A selector nibble's bit 3 would ask prmt to replicate the sign: cleared.
    u32 pick = 0x32103210u | ((q & 0x88888888u) >> 1), idx = q & 0x77777777u;
    u32 a0 = __byte_perm(IQ4_LEVELS_0, IQ4_LEVELS_1, idx);
    u32 a1 = __byte_perm(IQ4_LEVELS_2, IQ4_LEVELS_3, idx);
    u32 b0 = __byte_perm(IQ4_LEVELS_0, IQ4_LEVELS_1, idx >> 16);
    u32 b1 = __byte_perm(IQ4_LEVELS_2, IQ4_LEVELS_3, idx >> 16);
    u32 first = __byte_perm(a0, a1, pick), second = __byte_perm(b0, b1, pick >> 16);
    *lo = (int)__byte_perm(first, second, 0x6420);
    *hi = (int)__byte_perm(first, second, 0x7531);
}

// The IQ4_NL / IQ4_XS codebook level of nibble n (ggml's kvalues_iq4nl: -127, -104, -83,
// -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113) as a signed byte in the low 8
// bits: IQ4_LEVELS_*.
__device__ __forceinline__ u32 iq4_level(int n) {
    return n & 8 ? byte_of(IQ4_LEVELS_2, IQ4_LEVELS_3, n) : byte_of(IQ4_LEVELS_0, IQ4_LEVELS_1, n);
}

__device__ __forceinline__ float iq4_value(int n) { return (float)(i8)iq4_level(n); }

// The 6-bit scale of sub-block s (0..16) of a Q3_K block from its 12 packed bytes q,
// unbiased to -32..32.
__device__ __forceinline__ int scale_q3_k(int s, const u8* q) {
    int low = s < 8 ? (q[s] & 15) : (q[s - 8] >> 4);
    int high = (q[8 + (s & 3)] >> (2 * (s >> 2))) & 3;
    return (low | (high << 4)) - 32;
}

// The 6-bit scale of sub-block ib (0..8) of an IQ4_XS block b, unbiased to -32..32.
__device__ __forceinline__ int scale_iq4_xs(int ib, const u8* b) {
    int low = (b[4 + ib / 2] >> (4 * (ib & 1))) & 15;
    int high = (ld16(b + 2) >> (2 * ib)) & 3;
    return (low | (high << 4)) - 32;
}

// The hmask, qs and scale bytes and d of block blk of a Q3_K row, GGUF or packed.
__device__ __forceinline__ void q3_k_block(int ty, const u8* row, int blk, const u8** hm,
                                           const u8** qs, const u8** sc, float* d) {
    if (ty == TY_Q3_KP) {
        const u8* g = row + (blk >> 3) * 880;
        int n = blk & 7;
        *d = h2f(ld16(g + 2 * n));
        *sc = g + 16 + 12 * n;
        *hm = g + 112 + 32 * n;
        *qs = g + 368 + 64 * n;
    } else {
        const u8* b = row + blk * 110;
        *hm = b;
        *qs = b + 32;
        *sc = b + 96;
        *d = h2f(ld16(b + 108));
    }
}

// The 8-byte header and the 128 qs bytes of block blk of an IQ4_XS row, GGUF or packed.
__device__ __forceinline__ void iq4_xs_block(int ty, const u8* row, int blk, const u8** head,
                                             const u8** qs) {
    if (ty == TY_IQ4_XSP) {
        const u8* g = row + (blk >> 3) * 1088;
        *head = g + 8 * (blk & 7);
        *qs = g + 64 + 128 * (blk & 7);
    } else {
        *head = row + blk * 136;
        *qs = *head + 8;
    }
}

// Block blk of a Q6_K row in GGUF's layout or the packed one: its ql/qh/scales bytes and d.
__device__ __forceinline__ void q6_k_block(int ty, const u8* row, int blk, const u8** b, float* d) {
    if (ty == TY_Q6_KP) {
        const u8* g = row + (blk >> 3) * 1680;
        *b = g + 16 + 208 * (blk & 7);
        *d = h2f(ld16(g + 2 * (blk & 7)));
    } else {
        *b = row + blk * 210;
        *d = h2f(ld16(*b + 208));
    }
}

// Element e of a row of type ty (the slow, general path: embeddings and quantized caches).
// Each case computes what the cpu dequantizer of tether-gguf computes, in the same order.
__device__ float dequant_at(int ty, const u8* row, int e) {
    switch (ty) {
    case TY_F32: return ((const float*)row)[e];
    case TY_F16: return h2f(((const u16*)row)[e]);
    case TY_BF16: return bf2f(((const u16*)row)[e]);
    case TY_Q4_0: {
        const u8* b = row + (e / 32) * 18;
        int j = e % 32;
        int q = j < 16 ? (b[2 + j] & 15) : (b[2 + j - 16] >> 4);
        return (float)(q - 8) * h2f(ld16(b));
    }
    case TY_Q8_0: {
        const u8* b = row + (e / 32) * 34;
        return (float)(i8)b[2 + e % 32] * h2f(ld16(b));
    }
    case TY_Q4_1: {
        const u8* b = row + (e / 32) * 20;
        int j = e % 32;
        int q = j < 16 ? (b[4 + j] & 15) : (b[4 + j - 16] >> 4);
        return (float)q * h2f(ld16(b)) + h2f(ld16(b + 2));
    }
    case TY_Q5_0:
    case TY_Q5_1: {
        // {f16 d, [f16 m,] u32 qh, qs[16]}: bit j of qh is the fifth bit of element j.
        bool one = ty == TY_Q5_1;
        const u8* b = row + (e / 32) * (one ? 24 : 22);
        const u8* h = b + (one ? 4 : 2);
        int j = e % 32;
        u32 qh = (u32)ld16(h) | ((u32)ld16(h + 2) << 16);
        int q = (j < 16 ? (h[4 + j] & 15) : (h[4 + j - 16] >> 4)) | (((qh >> j) & 1) << 4);
        float d = h2f(ld16(b));
        return one ? (float)q * d + h2f(ld16(b + 2)) : (float)(q - 16) * d;
    }
    case TY_Q8_1: {
        const u8* b = row + (e / 32) * 36;
        return (float)(i8)b[4 + e % 32] * h2f(ld16(b));
    }
    case TY_Q8_K: {
        const u8* b = row + (e / 256) * 292;
        return (float)(i8)b[4 + e % 256] * __uint_as_float((u32)ld16(b) | ((u32)ld16(b + 2) << 16));
    }
    case TY_Q2_K: {
        // {scales[16], qs[64], f16 d, f16 dmin}; element 128h + 32j + k is bits 2j of
        // qs[32h + k], in sub-block (element / 16).
        const u8* b = row + (e / 256) * 84;
        int i = e % 256, h = i / 128, j = (i % 128) / 32, k = i % 32;
        int sc = b[i / 16];
        float dl = h2f(ld16(b + 80)) * (float)(sc & 15);
        float ml = h2f(ld16(b + 82)) * (float)(sc >> 4);
        int q = (b[16 + 32 * h + k] >> (2 * j)) & 3;
        return dl * (float)q - ml;
    }
    case TY_Q3_K:
    case TY_Q3_KP: {
        // {hmask[32], qs[64], scales[12], f16 d}: low bits as in Q2_K; a clear bit 4h + j
        // of hmask[k] lowers the value by 4. The packed layout keeps the parts apart.
        const u8 *hm, *qs, *sc;
        float d;
        q3_k_block(ty, row, e / 256, &hm, &qs, &sc, &d);
        int i = e % 256, h = i / 128, j = (i % 128) / 32, k = i % 32;
        float dl = d * (float)scale_q3_k(i / 16, sc);
        int q = (qs[32 * h + k] >> (2 * j)) & 3;
        if (!((hm[k] >> (4 * h + j)) & 1)) q -= 4;
        return dl * (float)q;
    }
    case TY_IQ4_NL: {
        const u8* b = row + (e / 32) * 18;
        int j = e % 32;
        int q = j < 16 ? (b[2 + j] & 15) : (b[2 + j - 16] >> 4);
        return h2f(ld16(b)) * iq4_value(q);
    }
    case TY_IQ4_XS:
    case TY_IQ4_XSP: {
        // {f16 d, u16 scales_h, scales_l[4], qs[128]}: sub-block ib's 32 values in 16 bytes
        // at 16 ib, low nibbles first. The packed layout keeps headers and qs apart.
        const u8 *b, *qs;
        iq4_xs_block(ty, row, e / 256, &b, &qs);
        int i = e % 256, ib = i / 32, j = i % 32;
        float dl = h2f(ld16(b)) * (float)scale_iq4_xs(ib, b);
        u8 byte = qs[16 * ib + (j & 15)];
        return dl * iq4_value(j < 16 ? (byte & 15) : (byte >> 4));
    }
    case TY_Q4_0P: {
        int b = e / 32, j = e % 32;
        const u8* g = row + (b >> 3) * 144;
        u8 byte = g[16 + 16 * (b & 7) + (j & 15)];
        int q = j < 16 ? (byte & 15) : (byte >> 4);
        return (float)(q - 8) * h2f(ld16(g + 2 * (b & 7)));
    }
    case TY_Q8_0P: {
        int b = e / 32;
        const u8* g = row + (b >> 3) * 272;
        return (float)(i8)g[16 + 32 * (b & 7) + e % 32] * h2f(ld16(g + 2 * (b & 7)));
    }
    case TY_Q4_K:
    case TY_Q5_K: {
        bool five = ty == TY_Q5_K;
        const u8* b = row + (e / 256) * (five ? 176 : 144);
        int i = e % 256, g = i / 64, k = i % 64, s = 2 * g + (k >= 32), l = k % 32;
        int sc, m;
        scale_min_k4(s, b + 4, &sc, &m);
        u8 byte = b[(five ? 48 : 16) + 32 * g + l];
        int q = k < 32 ? (byte & 15) : (byte >> 4);
        if (five) q += ((b[16 + l] >> s) & 1) << 4;
        return h2f(ld16(b)) * (float)sc * (float)q - h2f(ld16(b + 2)) * (float)m;
    }
    case TY_Q6_K:
    case TY_Q6_KP: {
        const u8* b;
        float d;
        q6_k_block(ty, row, e / 256, &b, &d);
        int i = e % 256, h = i / 128, r = i % 128, k = r / 32, l = r % 32;
        u8 qlb = b[64 * h + l + 32 * (k & 1)];
        int nib = k < 2 ? (qlb & 15) : (qlb >> 4);
        int hb = (b[128 + 32 * h + l] >> (2 * k)) & 3;
        int q = (nib | (hb << 4)) - 32;
        return d * (float)(i8)b[192 + 8 * h + l / 16 + 2 * k] * (float)q;
    }
    default: return __int_as_float(0x7fc00000);
    }
}

// 4-way byte dot product: unsigned bytes of a (Q4_0 nibbles) times signed bytes of b, plus c.
__device__ __forceinline__ int dp4a_us(u32 a, int b, int c) {
    int d;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}


// One value of an 8-bit block whose scale is 1 / id: rounded to nearest and saturated;
// NaN input gives 0, like the cpu's saturating cast.
__device__ __forceinline__ int q8_round(float v, float id) {
    float qf = roundf(v * id);
    return qf != qf ? 0 : (int)fminf(fmaxf(qf, -127.f), 127.f);
}

// One warp quantizes its 32 values (lane i holds v of element i of the block) into 8-bit
// q with scale d = amax / 127, as the cpu's quantize_row_q8 does, so both backends get the
// same integers; lane 0 writes (d, d * sum q).

__device__ __forceinline__ void q8_block(float v, int lane, i8* q, float2* ds) {
    float amax = fabsf(v);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    float d = amax / 127.0f;
    float id = d > 0.f ? 1.0f / d : 0.f;
    int qi = q8_round(v, id);
    *q = (i8)qi;
    int sum = qi;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0) *ds = make_float2(d, d * (float)sum);
}

// ---- Drivers of the 8-bit decode products (matvec_packed.cu, matvec_kquant.cu) ----
// Each takes a row policy P of a weight layout, which gives P::row_bytes(cols) and
// P::rows<NT, R, U>(rowp, cols, xq, xds, nt, lane, waited, acc): add this lane's share of
// each of the R rows at rowp times each token t < nt to acc[r][t], reading activations in
// 8-bit blocks (values xq [nt][cols], (scale, scale * sum) pairs xds [nt][cols / 32]) only
// after pdl_wait(), which it calls once (through `waited`).
// Launch shapes: the matvec and q/k/v drivers run PK_MV_WARPS warps a block of R rows each,
// gridDim.x = ceil(rows / (PK_MV_WARPS * R)) (q/k/v: that per matrix, in order); the
// gate/up driver runs 32 / R warps a block, PK_SW_ROWS rows, gridDim.x = ceil(rows / 32).
#define PK_MV_WARPS 4
#define PK_SW_ROWS 32

template <int R>
__device__ __forceinline__ void pk_row_ptrs(const u8* w, size_t row_bytes, int nrows,
                                            const u8* (&rowp)[R]) {
#pragma unroll
    for (int r = 0; r < R; r++) rowp[r] = w + (size_t)min(r, nrows - 1) * row_bytes;
}

template <int NT, int R>
__device__ __forceinline__ void pk_zero(float (&acc)[R][NT]) {
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int t = 0; t < NT; t++) acc[r][t] = 0.f;
}

// Sums every lane's share and stores row r's result for token t from lane r.
template <int NT, int R>
__device__ __forceinline__ void pk_store(float (&acc)[R][NT], int lane, int nrows, int nt,
                                         float* out, int rows, int accum) {
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int t = 0; t < NT; t++) {
            float v = warp_sum(acc[r][t]);
            if (lane == r && r < nrows && t < nt) {
                float* o = out + (size_t)t * rows + r;
                *o = accum ? *o + v : v;
            }
        }
}

// The rows of block b (PK_MV_WARPS warps of R rows) of a product: out[t][r] = w[r] . x[t],
// or += with accum.
template <class P, int NT, int R, int U>
__device__ __forceinline__ void pk_block_rows(const u8* w, int rows, int b, int cols,
                                              const i8* xq, const float2* xds, int nt,
                                              float* out, int accum) {
    int lane = threadIdx.x & 31;
    int first = (b * PK_MV_WARPS + (threadIdx.x >> 5)) * R;
    int nrows = min(R, rows - first);
    if (nrows <= 0) return;
    size_t row_bytes = P::row_bytes(cols);
    float acc[R][NT];
    pk_zero(acc);
    bool waited = false;
    const u8* rowp[R];
    pk_row_ptrs(w + (size_t)first * row_bytes, row_bytes, nrows, rowp);
    P::template rows<NT, R, U>(rowp, cols, xq, xds, nt, lane, waited, acc);
    pk_store(acc, lane, nrows, nt, out + first, rows, accum);
}

template <class P, int NT, int R, int U>
__device__ void pk_matvec(const u8* w, int rows, int cols, const i8* xq, const float2* xds,
                          int nt, float* out, int accum) {
    pdl_trigger();
    pk_block_rows<P, NT, R, U>(w, rows, blockIdx.x, cols, xq, xds, nt, out, accum);
}

// q, k and v of one input in one launch, each matrix with its own row policy (mixed files
// keep v in another type): the first ceil(r0 / rows per block) blocks take matrix 0, the
// next ones matrix 1, then matrix 2, so every branch is uniform across a block.
template <class P0, class P1, class P2, int NT, int R, int U>
__device__ void pk_matvec3_mixed(const u8* w0, const u8* w1, const u8* w2, int r0, int r1,
                                 int r2, int cols, const i8* xq, const float2* xds, int nt,
                                 float* o0, float* o1, float* o2) {
    pdl_trigger();
    const int per_block = PK_MV_WARPS * R;
    int b0 = (r0 + per_block - 1) / per_block, b1 = (r1 + per_block - 1) / per_block;
    int b = blockIdx.x;
    if (b < b0) {
        pk_block_rows<P0, NT, R, U>(w0, r0, b, cols, xq, xds, nt, o0, 0);
    } else if (b < b0 + b1) {
        pk_block_rows<P1, NT, R, U>(w1, r1, b - b0, cols, xq, xds, nt, o1, 0);
    } else {
        pk_block_rows<P2, NT, R, U>(w2, r2, b - b0 - b1, cols, xq, xds, nt, o2, 0);
    }
}

// q, k and v of one type.
template <class P, int NT, int R, int U>
__device__ void pk_matvec3(const u8* w0, const u8* w1, const u8* w2, int r0, int r1, int r2,
                           int cols, const i8* xq, const float2* xds, int nt, float* o0,
                           float* o1, float* o2) {
    pk_matvec3_mixed<P, P, P, NT, R, U>(w0, w1, w2, r0, r1, r2, cols, xq, xds, nt, o0, o1, o2);
}

// The feed-forward gate: out[t][r] = act(gate[r] . x[t]) * (up[r] . x[t]) (gate_act). A block's 32
// rows meet in shared memory, where one warp per token writes them (coalesced) and, when oq
// is set (rows a multiple of 32), their 8-bit copy for the down projection, which then
// skips its quantize pass.
template <class P, int NT, int R, int U>
__device__ void pk_swiglu(const u8* wg, const u8* wu, int rows, int cols, const i8* xq,
                          const float2* xds, int nt, float* out, i8* oq, float2* ods, int act) {
    __shared__ float vals[NT][PK_SW_ROWS];
    pdl_trigger();
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int base = blockIdx.x * PK_SW_ROWS, r0 = base + warp * R;
    int nrows = min(R, rows - r0);
    bool waited = false;
    if (nrows > 0) {
        size_t at = (size_t)r0 * P::row_bytes(cols);
        size_t row_bytes = P::row_bytes(cols);
        // Gate rows, then up rows: loading both in one round spilled registers (and read
        // slower) under the cap that fits every block on the GPU at once.
        float g[R][NT], u[R][NT];
        pk_zero(g);
        pk_zero(u);
        const u8* rowp[R];
        pk_row_ptrs(wg + at, row_bytes, nrows, rowp);
        P::template rows<NT, R, U>(rowp, cols, xq, xds, nt, lane, waited, g);
        pk_row_ptrs(wu + at, row_bytes, nrows, rowp);
        P::template rows<NT, R, U>(rowp, cols, xq, xds, nt, lane, waited, u);
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int t = 0; t < NT; t++) {
                float gs = warp_sum(g[r][t]), us = warp_sum(u[r][t]);
                if (lane == 0) vals[t][warp * R + r] = gate_act(gs, act) * us;
            }
    } else {
        pdl_wait();
    }
    __syncthreads();
    for (int t = warp; t < nt; t += PK_SW_ROWS / R) {
        int r = base + lane;
        float v = vals[t][lane];
        if (r < rows) out[(size_t)t * rows + r] = v;
        if (oq) {
            size_t at = (size_t)t * rows + r;
            q8_block(v, lane, oq + at, ods + at / 32);
        }
    }
}

// ---- Mixture-of-experts products over the chosen experts, 8-bit activations ----
// A launch runs a list of work items along gridDim.y; an item is one expert's rows times
// up to NT activation rows that lie one after another. Without a tile list (decode, NT = 1)
// item p is pick p: token p / k's expert ids[p], reading token p / k's row of the input and
// writing row p of its outputs. With one (prefill), moe_group (moe.cu) wrote the count of
// items at tiles[0] and item i as (expert, first row, rows) at tiles[1 + 3 i], the rows
// being the picks sorted by expert, inputs gathered in that order (moe_gather_q8). Items
// past the count and experts out of range write nothing (moe_sum skips those picks).
struct MoeItem {
    u32 expert;
    int token_row;  // the gate/up input row
    int row;        // the act row, and the down output row
    int n;
};

__device__ __forceinline__ bool moe_item(const u32* ids, const u32* tiles, int n_expert, int k,
                                         MoeItem* it) {
    int i = blockIdx.y;
    if (tiles) {
        if (i >= (int)tiles[0]) return false;
        it->expert = tiles[1 + 3 * i];
        it->row = it->token_row = (int)tiles[2 + 3 * i];
        it->n = (int)tiles[3 + 3 * i];
    } else {
        it->expert = ids[i];
        it->token_row = i / k;
        it->row = i;
        it->n = 1;
    }
    return it->expert < (u32)n_expert;
}

// act[row][r] = silu(gate_x[r] . x[token_row]) * (up_x[r] . x[token_row]) for each item's
// rows, and its 8-bit copy into aq/ads ([rows][ff], ff a multiple of 32) when aq is set.
// gate and up share one type, so one expert_bytes. Launch: gridDim = (ceil(ff / PK_SW_ROWS),
// items), blockDim.x = 32 * PK_SW_ROWS / R (pk_swiglu's shape); x in 8-bit blocks
// [rows][cols], cols whole groups of the policy's layout.
template <class P, int NT, int R, int U>
__device__ void moe_swiglu(const u8* wg, const u8* wu, u64 expert_bytes, const u32* ids,
                           const u32* tiles, int n_expert, int k, int ff, int cols, const i8* xq,
                           const float2* xds, float* act, i8* aq, float2* ads) {
    PDL_ENTRY();  // the item list and ids come from the kernels before
    MoeItem it;
    if (!moe_item(ids, tiles, n_expert, k, &it)) return;
    size_t w = (size_t)it.expert * expert_bytes, x = (size_t)it.token_row * cols;
    size_t a = (size_t)it.row * ff;
    pk_swiglu<P, NT, R, U>(wg + w, wu + w, ff, cols, xq + x, xds + x / 32, it.n, act + a,
                           aq ? aq + a : nullptr, aq ? ads + a / 32 : nullptr, GATE_SILU);
}

// out[row][r] = down_x[r] . act[row] for each item's rows (8-bit act aq/ads [rows][ff]).
// Launch: gridDim = (ceil(e / (PK_MV_WARPS * R)), items), blockDim.x = 32 * PK_MV_WARPS.
template <class P, int NT, int R, int U>
__device__ void moe_down(const u8* wd, u64 expert_bytes, const u32* ids, const u32* tiles,
                         int n_expert, int k, int e, int ff, const i8* aq, const float2* ads,
                         float* out) {
    PDL_ENTRY();
    MoeItem it;
    if (!moe_item(ids, tiles, n_expert, k, &it)) return;
    size_t a = (size_t)it.row * ff;
    pk_block_rows<P, NT, R, U>(wd + (size_t)it.expert * expert_bytes, e, blockIdx.x, ff, aq + a,
                               ads + a / 32, it.n, out + (size_t)it.row * e, 0);
}

// The MoE entries of one row policy: `prefix`_swiglu_`name`_NT and `prefix`_down_`name`_NT for
// NT 1 (decode, one pick an item) and 8 (tiles of the grouped prefill). U_SW and U_MV are
// the rounds in flight of the policy's gate/up and matvec kernels.
#define MOE_ENTRY(prefix, name, P, R, U_SW, U_MV, nt)                                             \
    extern "C" __global__ void __launch_bounds__(32 * PK_SW_ROWS / R, nt <= 2 ? 2 : 1)           \
        prefix##_swiglu_##name##_##nt(const u8* wg, const u8* wu, u64 expert_bytes,               \
                                      const u32* ids, const u32* tiles, int n_expert, int k,      \
                                      int ff, int cols, const i8* xq, const float2* xds,          \
                                      float* act, i8* aq, float2* ads) {                          \
        moe_swiglu<P, nt, R, U_SW>(wg, wu, expert_bytes, ids, tiles, n_expert, k, ff, cols, xq,  \
                                   xds, act, aq, ads);                                            \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(32 * PK_MV_WARPS) prefix##_down_##name##_##nt(   \
        const u8* wd, u64 expert_bytes, const u32* ids, const u32* tiles, int n_expert, int k,   \
        int e, int ff, const i8* aq, const float2* ads, float* out) {                             \
        moe_down<P, nt, R, U_MV>(wd, expert_bytes, ids, tiles, n_expert, k, e, ff, aq, ads, out); \
    }
#define MOE_ENTRIES(prefix, name, P, R, U_SW, U_MV) \
    MOE_ENTRY(prefix, name, P, R, U_SW, U_MV, 1) MOE_ENTRY(prefix, name, P, R, U_SW, U_MV, 8)

// The 8 consecutive values e0..e0+8 of a row of type ty, e0 a multiple of 8, every one of
// them < cols (the prefill GEMM's weight decoding and the MoE expert products). Quantized rows hold whole blocks of 32 (or 256) values, so the 8 values
// share one block and one scale.
__device__ __forceinline__ void decode8(int ty, const u8* row, int e0, float* v) {
    switch (ty) {
    case TY_Q4_0: {
        const u8* b = row + (e0 / 32) * 18;
        float d = h2f(ld16(b));
        int j0 = e0 % 32;
        const u8* q = b + 2 + (j0 % 16);
        int shift = j0 < 16 ? 0 : 4;
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = (float)(((q[i] >> shift) & 15) - 8) * d;
        return;
    }
    case TY_Q8_0: {
        const u8* b = row + (e0 / 32) * 34;
        float d = h2f(ld16(b));
        const u8* q = b + 2 + e0 % 32;
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = (float)(i8)q[i] * d;
        return;
    }
    case TY_Q4_0P: {
        int blk = e0 / 32, j0 = e0 % 32;
        const u8* g = row + (blk >> 3) * 144;
        float d = h2f(ld16(g + 2 * (blk & 7)));
        const u8* q = g + 16 + 16 * (blk & 7) + (j0 % 16);
        int shift = j0 < 16 ? 0 : 4;
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = (float)(((q[i] >> shift) & 15) - 8) * d;
        return;
    }
    case TY_Q8_0P: {
        int blk = e0 / 32;
        const u8* g = row + (blk >> 3) * 272;
        float d = h2f(ld16(g + 2 * (blk & 7)));
        const u8* q = g + 16 + 32 * (blk & 7) + e0 % 32;
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = (float)(i8)q[i] * d;
        return;
    }
    case TY_Q4_K:
    case TY_Q5_K: {
        bool five = ty == TY_Q5_K;
        const u8* b = row + (e0 / 256) * (five ? 176 : 144);
        int i = e0 % 256, g = i / 64, k = i % 64, s = 2 * g + (k >= 32), l0 = k % 32;
        int sc, m;
        scale_min_k4(s, b + 4, &sc, &m);
        float d = h2f(ld16(b)) * (float)sc, dm = h2f(ld16(b + 2)) * (float)m;
        const u8* q = b + (five ? 48 : 16) + 32 * g + l0;
        int shift = k < 32 ? 0 : 4;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            int qv = (q[j] >> shift) & 15;
            if (five) qv += ((b[16 + l0 + j] >> s) & 1) << 4;
            v[j] = d * (float)qv - dm;
        }
        return;
    }
    case TY_Q6_K:
    case TY_Q6_KP: {
        const u8* b;
        float d;
        q6_k_block(ty, row, e0 / 256, &b, &d);
        int i = e0 % 256, h = i / 128, r = i % 128, k = r / 32, l0 = r % 32;
        // l0..l0+8 stays inside one half of 16, so one scale serves all 8.
        d *= (float)(i8)b[192 + 8 * h + l0 / 16 + 2 * k];
        const u8* ql = b + 64 * h + 32 * (k & 1) + l0;
        const u8* qh = b + 128 + 32 * h + l0;
        int shift = k < 2 ? 0 : 4;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            int q = (((ql[j] >> shift) & 15) | (((qh[j] >> (2 * k)) & 3) << 4)) - 32;
            v[j] = d * (float)q;
        }
        return;
    }
    case TY_IQ4_XS:
    case TY_IQ4_XSP: {
        const u8 *b, *qs;
        iq4_xs_block(ty, row, e0 / 256, &b, &qs);
        int i = e0 % 256, ib = i / 32, j0 = i % 32;
        float dl = h2f(ld16(b)) * (float)scale_iq4_xs(ib, b);
        const u8* q = qs + 16 * ib + (j0 & 15);
        int shift = j0 < 16 ? 0 : 4;
#pragma unroll
        for (int j = 0; j < 8; j++) v[j] = dl * iq4_value((q[j] >> shift) & 15);
        return;
    }
    case TY_Q3_K:
    case TY_Q3_KP: {
        // 8 values share one sub-block of 16 (one scale) and one 2-bit plane.
        const u8 *hm, *qs, *sc;
        float d;
        q3_k_block(ty, row, e0 / 256, &hm, &qs, &sc, &d);
        int i = e0 % 256, h = i / 128, j = (i % 128) / 32, k0 = i % 32;
        float dl = d * (float)scale_q3_k(i / 16, sc);
        int bit = 4 * h + j;
#pragma unroll
        for (int l = 0; l < 8; l++) {
            int q = (qs[32 * h + k0 + l] >> (2 * j)) & 3;
            if (!((hm[k0 + l] >> bit) & 1)) q -= 4;
            v[l] = dl * (float)q;
        }
        return;
    }
    default:
#pragma unroll
        for (int j = 0; j < 8; j++) v[j] = dequant_at(ty, row, e0 + j);
    }
}

// Tensor-core and asynchronous-copy building blocks (sm_80 and later): the GEMM and the
// flash-attention kernels stage f16 tiles in shared memory and multiply them with mma.sync.

__device__ __forceinline__ u32 smem_addr(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}

// 16 bytes global -> shared, bypassing L1; src_bytes 0 fills zeros (rows past the edge).
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }

template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(u32 addr, u32* r) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void mma_16816(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ldmatrix_x4 with each 8x8 matrix transposed: rows of the shared tile become columns of
// the fragment (the B operand from a row-major [k][n] tile).
__device__ __forceinline__ void ldmatrix_x4_trans(u32 addr, u32* r) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// ---- int8 tensor cores (matvec_mma.cu, mmq.cu) ----
// c = a . b over k = 32 for 16 rows and 8 tokens; a's bytes unsigned (Q4_0's nibbles) or
// signed (Q8_0), b's signed.
template <bool UNSIGNED_A>
__device__ __forceinline__ void mma_8bit(int (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
#if __CUDA_ARCH__ >= 800
    if (UNSIGNED_A) {
        asm volatile(
            "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0, %1, %2, %3}, "
            "{%4, %5, %6, %7}, {%8, %9}, {%10, %10, %10, %10};"
            : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(0));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, "
            "{%4, %5, %6, %7}, {%8, %9}, {%10, %10, %10, %10};"
            : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(0));
    }
#else
    c[0] = c[1] = c[2] = c[3] = 0;
#endif
}

// ---- quantized blocks as f16 tensor-core operands (mmq.cu, gemm.cu) ----
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
            v |= iq4_level(n) << (8 * s);
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

// f16 pairs in 32-bit registers (NVRTC compiles these kernels without cuda_fp16.h).
__device__ __forceinline__ u32 h2_sub(u32 a, u32 b) {
    u32 d;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
__device__ __forceinline__ u32 h2_fma(u32 a, u32 b, u32 c) {
    u32 d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
__device__ __forceinline__ u32 h2_of(float f) {
    u32 d;
    asm("cvt.rn.f16x2.f32 %0, %1, %1;" : "=r"(d) : "f"(f));
    return d;
}

// Four quant bytes (signed, or unsigned for the types with a min) as two f16 pairs,
// bytes (0, 2) and (1, 3), each times scale s plus nm (minus the min): 0x64XX is the f16
// 1024 + XX, so a byte permute and one subtraction make a byte an exact f16.
template <bool UNSIGNED>
__device__ __forceinline__ void mmq_halves(u32 v, u32 s, u32 nm, u32* lo, u32* hi) {
    const u32 u = UNSIGNED ? v : v ^ 0x80808080u;
    // 1024 (0x6400) or 1024 + 128 (0x6480) in both halves.
    const u32 bias = UNSIGNED ? 0x64006400u : 0x64806480u;
    *lo = h2_fma(h2_sub(__byte_perm(u, 0x64646464u, 0x4240), bias), s, nm);
    *hi = h2_fma(h2_sub(__byte_perm(u, 0x64646464u, 0x4341), bias), s, nm);
}
