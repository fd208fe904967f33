// Mixture-of-experts: routing, and the expert products reading only the chosen experts'
// rows. The expert ids stay on the device from the router to the products, so a decode
// step recorded as a CUDA graph needs no host round trip.
//
// Stacked expert tensors: expert x's matrix starts at byte x * expert_bytes and row r of it
// at r * row_bytes after that; every row is whole blocks of its type (packed types keep
// each row where it was, see packed.rs), so decode8 reads a row from its start.
//
// moe_gate_up / moe_down decode weights 8 consecutive values at a time by each lane with
// common.cuh's decode8 (a warp step covers 256 values: one K-quant block, or 8 Q8_0
// blocks), with f32 activations: the path of the types and widths the 8-bit kernels
// (common.cuh's moe_swiglu / moe_down, see cuda/moe_int8.rs) do not take. moe_sum,
// moe_group and moe_gather_q8 serve those 8-bit kernels.

#define MOE_MAX_EXPERTS 1024
#define MOE_WARPS 4

// row . x over cols values (a multiple of 8), this lane's share: 8 values at 8 lane + 256 i.
__device__ __forceinline__ float moe_dot_lane(int ty, const u8* row, const float* x, int cols,
                                              int lane) {
    float s = 0.f;
    for (int c = 8 * lane; c < cols; c += 256) {
        float w[8];
        decode8(ty, row, c, w);
        float4 a = *(const float4*)(x + c), b = *(const float4*)(x + c + 4);
        s += w[0] * a.x + w[1] * a.y + w[2] * a.z + w[3] * a.w;
        s += w[4] * b.x + w[5] * b.y + w[6] * b.z + w[7] * b.w;
    }
    return s;
}

// Softmax over each token's router logits, then the k most probable experts (the lower id
// first among equals), in order, with their probabilities (divided by their sum when norm).
// Computes what tether_compute::moe::route_token computes.
// Launch: gridDim.x = nt (one block per token), blockDim.x = 32 (one warp).
// Assumes: n_expert <= MOE_MAX_EXPERTS, 1 <= k <= n_expert (checked on the host).
extern "C" __global__ void moe_route(const float* logits, int n_expert, int k, int norm, int nt,
                                     u32* ids, float* weights) {
    PDL_ENTRY();
    __shared__ float s[MOE_MAX_EXPERTS];
    __shared__ u8 taken[MOE_MAX_EXPERTS];
    int t = blockIdx.x, lane = threadIdx.x;
    if (t >= nt) return;
    const float* row = logits + (size_t)t * n_expert;
    float mx = NEG_INF;
    for (int e = lane; e < n_expert; e += 32) {
        float v = row[e];
        s[e] = v;
        taken[e] = 0;
        mx = fmaxf(mx, v);
    }
    mx = warp_max(mx);
    float sum = 0.f;
    for (int e = lane; e < n_expert; e += 32) sum += expf(s[e] - mx);
    sum = warp_sum(sum);
    __syncwarp();
    u32* out_ids = ids + (size_t)t * k;
    float* out_w = weights + (size_t)t * k;
    float total = 0.f;
    for (int j = 0; j < k; j++) {
        float best = NEG_INF;
        int bi = -1;
        for (int e = lane; e < n_expert; e += 32) {
            if (!taken[e] && (bi < 0 || s[e] > best)) {
                best = s[e];
                bi = e;
            }
        }
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, best, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (oi >= 0 && (bi < 0 || ov > best || (ov == best && oi < bi))) {
                best = ov;
                bi = oi;
            }
        }
        if (bi < 0) bi = 0;
        float p = expf(best - mx) / sum;
        if (lane == 0) {
            taken[bi] = 1;
            out_ids[j] = (u32)bi;
            out_w[j] = p;
        }
        total += p;
        __syncwarp();
    }
    if (norm && lane == 0 && total > 0.f) {
        for (int j = 0; j < k; j++) out_w[j] /= total;
    }
}

// act[p][r] = silu(gate_x[r] . x[p / k]) * (up_x[r] . x[p / k]) for pick p (token p / k,
// its (p % k)-th expert x = ids[p]); a pick whose id is out of range gets 0.
// Launch: gridDim = (picks, ceil(ff / MOE_WARPS)), blockDim.x = 32 * MOE_WARPS; one warp
// per (row, pick). Picks vary fastest, so the blocks running at once read the same rows of
// the experts (a prefill batch finds them in L2 instead of reading each expert per token). Assumes: e is whole blocks of both types and a multiple of 8, x and act
// f32 rows 16-byte aligned (checked on the host).
extern "C" __global__ void moe_gate_up(const u8* wg, const u8* wu, int tyg, int tyu,
                                       u64 gate_bytes, u64 up_bytes, u64 row_bytes_g,
                                       u64 row_bytes_u, const float* x, const u32* ids,
                                       int n_expert, int e, int ff, int k, float* act) {
    PDL_ENTRY();
    int lane = threadIdx.x & 31;
    int r = blockIdx.y * MOE_WARPS + (threadIdx.x >> 5);
    int p = blockIdx.x;
    if (r >= ff) return;
    u32 id = ids[p];
    float* o = act + (size_t)p * ff + r;
    if (id >= (u32)n_expert) {
        if (lane == 0) *o = 0.f;
        return;
    }
    const u8* g = wg + id * gate_bytes + (u64)r * row_bytes_g;
    const u8* u = wu + id * up_bytes + (u64)r * row_bytes_u;
    const float* xr = x + (size_t)(p / k) * e;
    float sg = warp_sum(moe_dot_lane(tyg, g, xr, e, lane));
    float su = warp_sum(moe_dot_lane(tyu, u, xr, e, lane));
    if (lane == 0) *o = sg / (1.f + expf(-sg)) * su;
}

// acc[t][r] += sum_j weights[t][j] * (down_x[r] . act[t * k + j]) with x = ids[t][j];
// picks with an out-of-range id add nothing.
// Launch: gridDim = (nt, ceil(e / MOE_WARPS)), blockDim.x = 32 * MOE_WARPS; one warp per
// (row, token), which sums its token's experts, so no two warps write one value; tokens
// vary fastest, as in moe_gate_up.
// Assumes: ff is whole blocks of tyd and a multiple of 8 (checked on the host).
extern "C" __global__ void moe_down(const u8* wd, int tyd, u64 down_bytes, u64 row_bytes_d,
                                    const float* act, const u32* ids, const float* weights,
                                    int n_expert, int e, int ff, int k, float* acc) {
    PDL_ENTRY();
    int lane = threadIdx.x & 31;
    int r = blockIdx.y * MOE_WARPS + (threadIdx.x >> 5);
    int t = blockIdx.x;
    if (r >= e) return;
    float total = 0.f;
    for (int j = 0; j < k; j++) {
        int p = t * k + j;
        u32 id = ids[p];
        if (id >= (u32)n_expert) continue;
        const u8* d = wd + id * down_bytes + (u64)r * row_bytes_d;
        const float* a = act + (size_t)p * ff;
        total += weights[p] * warp_sum(moe_dot_lane(tyd, d, a, ff, lane));
    }
    if (lane == 0) acc[(size_t)t * e + r] += total;
}

// acc[t][r] += sum over j < k (in order) of weights[t][j] * out[row(t * k + j)][r], row(p)
// being p without a row list (decode) and row_of[p] with one (prefill); picks whose id is
// out of range add nothing. The weighted sum of the 8-bit products (common.cuh's moe_down,
// which writes each pick's row apart so that no two blocks add into one value).
// Launch: any grid of 1-D blocks (grid-stride over nt * e values).
extern "C" __global__ void moe_sum(const float* out, const u32* ids, const int* row_of,
                                   const float* weights, int n_expert, int e, int k, int nt,
                                   float* acc) {
    PDL_ENTRY();
    u64 total = (u64)nt * e;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < total;
         i += (u64)gridDim.x * blockDim.x) {
        u64 t = i / e, r = i % e;
        float s = 0.f;
        for (int j = 0; j < k; j++) {
            u64 p = t * k + j;
            if (ids[p] >= (u32)n_expert) continue;
            u64 row = row_of ? (u64)row_of[p] : p;
            s += weights[p] * out[row * e + r];
        }
        acc[i] += s;
    }
}

// Sorts the picks by expert for the grouped products: row_of[p] is pick p's row (-1 for an
// id out of range), expert x's picks taking the rows after those of experts below x (experts in
// order; picks within an expert in any order, since each row's result is its own), and
// tiles gets the item list of common.cuh's MoE drivers: its length, then (expert, first
// row, rows) for every run of at most `tile` rows of one expert.
// Launch: one block of MOE_GROUP_THREADS threads. Assumes n_expert <= MOE_MAX_EXPERTS and
// tiles holding 1 + 3 * (ceil(picks / tile) + n_expert) words (checked on the host).
#define MOE_GROUP_THREADS 1024
extern "C" __global__ void __launch_bounds__(MOE_GROUP_THREADS)
    moe_group(const u32* ids, int picks, int n_expert, int tile, int* row_of, u32* tiles) {
    PDL_ENTRY();
    __shared__ int count[MOE_MAX_EXPERTS];
    __shared__ int next[MOE_MAX_EXPERTS];
    for (int x = threadIdx.x; x < n_expert; x += blockDim.x) count[x] = 0;
    __syncthreads();
    for (int p = threadIdx.x; p < picks; p += blockDim.x) {
        u32 id = ids[p];
        if (id < (u32)n_expert) atomicAdd(&count[id], 1);
    }
    __syncthreads();
    // Exclusive scan of the counts and the tiles of each expert, by one warp: each lane
    // takes a contiguous run of experts.
    if (threadIdx.x < 32) {
        int lane = threadIdx.x, per = (n_expert + 31) / 32;
        int x0 = min(lane * per, n_expert), x1 = min(x0 + per, n_expert);
        int rows = 0, ntiles = 0;
        for (int x = x0; x < x1; x++) {
            rows += count[x];
            ntiles += (count[x] + tile - 1) / tile;
        }
        int row0 = rows, tile0 = ntiles;
        for (int o = 1; o < 32; o <<= 1) {
            int a = __shfl_up_sync(0xffffffffu, row0, o), b = __shfl_up_sync(0xffffffffu, tile0, o);
            if (lane >= o) {
                row0 += a;
                tile0 += b;
            }
        }
        row0 -= rows;
        tile0 -= ntiles;
        for (int x = x0; x < x1; x++) {
            next[x] = row0;
            for (int r = 0; r < count[x]; r += tile) {
                u32* t = tiles + 1 + 3 * tile0++;
                t[0] = (u32)x;
                t[1] = (u32)(row0 + r);
                t[2] = (u32)min(tile, count[x] - r);
            }
            row0 += count[x];
        }
        if (lane == 31) tiles[0] = (u32)tile0;
    }
    __syncthreads();
    for (int p = threadIdx.x; p < picks; p += blockDim.x) {
        u32 id = ids[p];
        row_of[p] = id < (u32)n_expert ? atomicAdd(&next[id], 1) : -1;
    }
}

// Row row_of[p] of xq/xds (8-bit blocks, [rows][cols]) = the 8-bit copy of pick p's token
// row x[p / k], for every pick with a row: the grouped products' input, quantized as
// quantize_q8 does. Launch: blockDim.x = 256, one warp per block of 32 values, picks * cols
// / 32 warps in all; cols a multiple of 32.
extern "C" __global__ void __launch_bounds__(256)
    moe_gather_q8(const float* x, const int* row_of, int picks, int k, int cols, i8* xq,
                  float2* xds) {
    PDL_ENTRY();
    u64 warp = (blockIdx.x * (u64)blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31, nb = cols / 32;
    if (warp >= (u64)picks * nb) return;
    int p = (int)(warp / nb), b = (int)(warp % nb);
    int row = row_of[p];
    if (row < 0) return;
    size_t at = (size_t)row * cols + (size_t)b * 32 + lane;
    q8_block(x[(size_t)(p / k) * cols + (size_t)b * 32 + lane], lane, xq + at,
             xds + (size_t)row * nb + b);
}
