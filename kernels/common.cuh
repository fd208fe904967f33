// Shared helpers for every tether kernel file. NVRTC compiles each .cu file with this text
// prepended (no #include, so no CUDA toolkit headers are needed at run time).
//
// Type ids are ggml's: F32 0, F16 1, Q4_0 2, Q8_0 8, Q4_K 12, Q5_K 13, Q6_K 14, BF16 30.

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define TY_F32 0
#define TY_F16 1
#define TY_Q4_0 2
#define TY_Q8_0 8
#define TY_Q4_K 12
#define TY_Q5_K 13
#define TY_Q6_K 14
#define TY_BF16 30
// Q4_0 and Q8_0 in the packed layout of matvec_packed.cu (not ggml ids): rows of groups of
// 8 blocks, the group's 8 f16 scales first, then its blocks' quants.
#define TY_Q4_0P 1002
#define TY_Q8_0P 1008

#define NEG_INF __int_as_float(0xff800000)

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

// Element e of a row of type ty (the slow, general path: embeddings and quantized caches).
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
    case TY_Q6_K: {
        const u8* b = row + (e / 256) * 210;
        int i = e % 256, h = i / 128, r = i % 128, k = r / 32, l = r % 32;
        u8 qlb = b[64 * h + l + 32 * (k & 1)];
        int nib = k < 2 ? (qlb & 15) : (qlb >> 4);
        int hb = (b[128 + 32 * h + l] >> (2 * k)) & 3;
        int q = (nib | (hb << 4)) - 32;
        return h2f(ld16(b + 208)) * (float)(i8)b[192 + 8 * h + l / 16 + 2 * k] * (float)q;
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
