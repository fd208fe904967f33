// The k most likely entries of logits rows, found on the device so a sampled decode step
// downloads k (id, logit) pairs a row instead of the whole row (512 KiB on a 128k
// vocabulary), in the sampler's order: highest value first by total order (+0 above -0,
// +inf above all), NaN never, the lowest index first among equals.
//
// Radix select on each value's order-preserving 32-bit key, one block a row: three passes
// over the row fix the k-th largest key T 11, 11 and 10 bits at a time from per-digit
// counts; a last pass writes every entry above T and the lowest-indexed entries equal to
// T that complete k. The row stays in L2 between passes.

#define SEL_THREADS 1024
// Entries equal to T gathered in shared memory to rank them by index; a row with more
// ties at T than this ranks them in index order tile by tile instead (slower, same result).
#define SEL_TIES 2048

__device__ __forceinline__ u32 order_key(float v) {
    const u32 b = __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float key_value(u32 key) {
    return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// Exclusive prefix sum of `v` over the block in thread order; `*total` gets the sum.
// Every thread of the block must call it.
__device__ u32 block_exclusive_sum(u32 v, u32* total) {
    __shared__ u32 warps[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n_warps = (int)(blockDim.x >> 5);
    u32 incl = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const u32 t = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += t;
    }
    if (lane == 31) warps[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        u32 w = lane < n_warps ? warps[lane] : 0;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const u32 t = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += t;
        }
        warps[lane] = w;
    }
    __syncthreads();
    const u32 before = (warp > 0 ? warps[warp - 1] : 0) + incl - v;
    *total = warps[n_warps - 1];
    __syncthreads();
    return before;
}

// Output: `out[0..rows)` the count of each row (k, or fewer when the row has fewer
// non-NaN values), then row r's pairs at `out + rows + 2*k*r`: index, then the value's
// bits, in no particular order (the host sorts them). Launch: gridDim.x = rows,
// blockDim.x = SEL_THREADS.
extern "C" __global__ void __launch_bounds__(SEL_THREADS)
    top_rows(const float* x, u64 n, int k_, int rows_, u32* out) {
    PDL_ENTRY();
    const u32 k = (u32)k_, rows = (u32)rows_;
    __shared__ u32 hist[2048];
    __shared__ u32 ties[SEL_TIES];
    __shared__ u32 s_prefix, s_mask, s_need, s_above, s_ties, s_all;
    const float* row = x + (u64)blockIdx.x * n;
    u32* pairs = out + rows + (u64)2 * k * blockIdx.x;
    const u32 t = threadIdx.x;
    if (t == 0) {
        s_prefix = 0;
        s_mask = 0;
        s_need = k;
        s_above = 0;
        s_ties = 0;
        s_all = 0;
    }
    const int widths[3] = {11, 11, 10};
    int shift = 32;
    for (int pass = 0; pass < 3; ++pass) {
        const int width = widths[pass];
        shift -= width;
        const u32 bins = 1u << width;
        for (u32 b = t; b < 2048; b += blockDim.x) hist[b] = 0;
        __syncthreads();
        // Read before any thread can update them below (after the syncs in the sum).
        const u32 prefix = s_prefix, mask = s_mask, need = s_need;
        // Every thread of a warp takes the same number of turns, for the warp-wide match.
        for (u64 tile = 0; tile < n; tile += blockDim.x) {
            const u64 i = tile + t;
            const float v = i < n ? row[i] : __int_as_float(0x7fc00000);
            const u32 key = order_key(v);
            const bool counted = v == v && (key & mask) == prefix;
            const u32 bin = counted ? (key >> shift) & (bins - 1) : 0xffffffffu;
            // Logits crowd into few leading digits: one atomic per distinct bin a warp.
            const u32 same = __match_any_sync(0xffffffffu, bin);
            if (counted && (__ffs(same) - 1) == (int)(t & 31)) atomicAdd(&hist[bin], __popc(same));
        }
        __syncthreads();
        // Thread t holds the bins 2t and 2t+1 counted from the top, so the exclusive sum in
        // thread order is how many counted values lie in higher bins.
        const int hi = (int)bins - 1 - 2 * (int)t, lo = hi - 1;
        const u32 c_hi = hi >= 0 ? hist[hi] : 0, c_lo = lo >= 0 ? hist[lo] : 0;
        u32 counted_all;
        const u32 above = block_exclusive_sum(c_hi + c_lo, &counted_all);
        if (pass == 0 && counted_all <= k) {
            // k or fewer values that are not NaN: every one of them.
            if (t == 0) s_all = 1;
        } else if (above < need && above + c_hi >= need) {
            s_prefix = prefix | ((u32)hi << shift);
            s_need = need - above;
        } else if (above + c_hi < need && above + c_hi + c_lo >= need) {
            s_prefix = prefix | ((u32)lo << shift);
            s_need = need - above - c_hi;
        }
        if (t == 0) s_mask = mask | ((bins - 1) << shift);
        __syncthreads();
        if (s_all) break;
    }
    const bool all = s_all != 0;
    const u32 cut = s_prefix, need = s_need;
    const u32 base = k - need;
    for (u64 i = t; i < n; i += blockDim.x) {
        const float v = row[i];
        if (v != v) continue;
        const u32 key = order_key(v);
        if (all || key > cut) {
            const u32 at = atomicAdd(&s_above, 1u);
            pairs[2 * at] = (u32)i;
            pairs[2 * at + 1] = __float_as_uint(v);
        } else if (key == cut) {
            const u32 at = atomicAdd(&s_ties, 1u);
            if (at < SEL_TIES) ties[at] = (u32)i;
        }
    }
    __syncthreads();
    const u32 n_ties = s_ties;
    if (!all && n_ties <= SEL_TIES) {
        // Rank each tie by how many ties have a lower index; the `need` lowest are kept.
        for (u32 j = t; j < n_ties; j += blockDim.x) {
            const u32 id = ties[j];
            u32 rank = 0;
            for (u32 m = 0; m < n_ties; ++m) rank += ties[m] < id;
            if (rank < need) {
                pairs[2 * (base + rank)] = id;
                pairs[2 * (base + rank) + 1] = __float_as_uint(key_value(cut));
            }
        }
    } else if (!all) {
        // Too many ties to gather: walk the row in index order, a block-wide tile at a time.
        u32 taken = 0;
        for (u64 tile = 0; tile < n && taken < need; tile += blockDim.x) {
            const u64 i = tile + t;
            const bool tie = i < n && row[i] == row[i] && order_key(row[i]) == cut;
            u32 in_tile;
            const u32 before = block_exclusive_sum(tie ? 1u : 0u, &in_tile);
            if (tie && taken + before < need) {
                pairs[2 * (base + taken + before)] = (u32)i;
                pairs[2 * (base + taken + before) + 1] = __float_as_uint(key_value(cut));
            }
            taken += in_tile;
        }
    }
    if (t == 0) out[blockIdx.x] = all ? s_above : k;
}

// exp(from - to) for merging running sums kept relative to maxima `from` <= `to`; 1 when
// they are equal, so that two +inf or two -inf maxima never make NaN.
__device__ __forceinline__ float rescale(float from, float to) {
    return from == to ? 1.0f : expf(from - to);
}

// Merges the running pair (m2, s2) into (m, s): s sums exp(v - m) over the values seen.
__device__ __forceinline__ void lse_merge(float* m, float* s, float m2, float s2) {
    if (m2 > *m) {
        *s = *s * rescale(*m, m2) + s2;
        *m = m2;
    } else {
        *s += s2 * rescale(m2, *m);
    }
}

#define NEG_INF __int_as_float(0xff800000)
#define POS_INF __int_as_float(0x7f800000)

// The normalizer of each logits row's softmax, so log-probabilities come without the row
// leaving the device: out[2r] = log(sum exp(v)) over the non-NaN values of row r (-inf
// when none is above -inf, +inf when one is +inf), out[2r+1] = the row's value at
// targets[r] when `has_targets`, else NaN. Each thread keeps a running (max, sum of
// exp(v - max)) over a strided slice of the row; warps, then the block, merge them.
// `targets` and `out` may lie in one buffer as long as they do not overlap. Launch:
// gridDim.x = rows, blockDim.x = a multiple of 32 up to SEL_THREADS.
extern "C" __global__ void __launch_bounds__(SEL_THREADS)
    score_rows(const float* x, u64 n, const u32* targets, int has_targets, float* out) {
    PDL_ENTRY();
    const float* row = x + (u64)blockIdx.x * n;
    float m = NEG_INF, s = 0.0f;
    for (u64 i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = row[i];
        if (v != v) continue;
        lse_merge(&m, &s, v, 1.0f);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
        const float s2 = __shfl_xor_sync(0xffffffffu, s, o);
        lse_merge(&m, &s, m2, s2);
    }
    __shared__ float warp_m[32], warp_s[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        warp_m[warp] = m;
        warp_s[warp] = s;
    }
    __syncthreads();
    if (warp != 0) return;
    const bool live = lane < (int)(blockDim.x >> 5);
    m = live ? warp_m[lane] : NEG_INF;
    s = live ? warp_s[lane] : 0.0f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
        const float s2 = __shfl_xor_sync(0xffffffffu, s, o);
        lse_merge(&m, &s, m2, s2);
    }
    if (lane == 0) {
        // A row of -inf (or of NaN) has s = its count or 0: either way the sum is 0.
        const float lse = (m == NEG_INF || m == POS_INF) ? m : m + logf(s);
        out[2 * blockIdx.x] = lse;
        out[2 * blockIdx.x + 1] =
            has_targets ? row[targets[blockIdx.x]] : __int_as_float(0x7fc00000);
    }
}
