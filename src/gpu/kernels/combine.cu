// combine: expert outputs back to their source (reversed plan) and the reductions.
// Specialised by IN_DTYPE (expert output dtype), OUT_DTYPE and TOPK. Accumulation is f32 with
// explicit __fmul_rn/__fadd_rn (no FMA contraction) in a fixed order, so results are
// bit-reproducible and equal to the CPU path's `acc += w * y`.
#ifndef IN_DTYPE
#define IN_DTYPE 0
#endif
#ifndef OUT_DTYPE
#define OUT_DTYPE 0
#endif

#if IN_DTYPE == 0
typedef float in_t;
__device__ __forceinline__ float ep_load_in(const in_t* p, u64 i) { return p[i]; }
#elif IN_DTYPE == 1
typedef u16 in_t;
__device__ __forceinline__ float ep_load_in(const in_t* p, u64 i) { return bf16_to_f32(p[i]); }
#else
typedef u16 in_t;
__device__ __forceinline__ float ep_load_in(const in_t* p, u64 i) { return f16_to_f32(p[i]); }
#endif

#if OUT_DTYPE == 0
typedef float out_t;
__device__ __forceinline__ out_t ep_to_out(float v) { return v; }
#elif OUT_DTYPE == 1
typedef u16 out_t;
__device__ __forceinline__ out_t ep_to_out(float v) { return f32_to_bf16(v); }
#else
typedef u16 out_t;
__device__ __forceinline__ out_t ep_to_out(float v) { return f32_to_f16(v); }
#endif

// EXPERT_MAJOR / EXPERT_PACKED, on the expert rank: one warp per received (row n, k) whose id
// is owned by `rank`; copies that expert's output row for row n to send row pair_pos[n*TOPK+k]
// (pair_pos = ep_scan of ep_recv_flags' pair_flag: by source rank, then token, then k — the
// order the source's ep_pair_rows expects). capacity > 0: y is [E_local, capacity, row] buckets;
// capacity == 0: y is the packed [N_rows, row].
extern "C" __global__ void ep_combine_return_expert(const u8* __restrict__ y, u64 row_bytes,
                                                    const int* __restrict__ recv_ids, int N,
                                                    int E_local, int rank,
                                                    const int* __restrict__ expert_pos,
                                                    int capacity,
                                                    const int* __restrict__ pair_pos,
                                                    u8* __restrict__ send_rows) {
    const u32 lane = ep_lane();
    const int base = rank * E_local;
    for (u64 i = ep_global_warp(); i < (u64)N * TOPK; i += ep_num_warps()) {
        const int v = recv_ids[i];
        if (v < base || v >= base + E_local) continue;
        const u64 j = (u64)(v - base), n = i / TOPK;
        const u64 e = j * (u64)N + n;
        const u64 src = capacity > 0
                            ? j * (u64)capacity + (u64)(expert_pos[e] - expert_pos[j * (u64)N])
                            : (u64)expert_pos[e];
        ep_copy_bytes(send_rows + (u64)pair_pos[i] * row_bytes, y + src * row_bytes, row_bytes,
                      lane, 32);
    }
}

// RANK_MAJOR, on the expert rank: compacts the [R, M, row] output back into the wire order of
// the receive buffer (region s rows [0, count_s) → send row recv_offsets[s] + m).
extern "C" __global__ void ep_combine_return_rank_major(const u8* __restrict__ y, u64 row_bytes,
                                                        const int* __restrict__ recv_offsets,
                                                        int R, int M,
                                                        u8* __restrict__ send_rows) {
    const u32 lane = ep_lane();
    for (u64 i = ep_global_warp(); i < (u64)R * (u64)M; i += ep_num_warps()) {
        const u64 s = i / (u64)M, m = i % (u64)M;
        if (m >= (u64)(recv_offsets[s + 1] - recv_offsets[s])) continue;
        ep_copy_bytes(send_rows + ((u64)recv_offsets[s] + m) * row_bytes, y + i * row_bytes,
                      row_bytes, lane, 32);
    }
}

// On the source: out[t, :] = sum over k = 0..TOPK-1 (in order) of w[t,k] * y[rows[t,k], :],
// skipping rows[t,k] == -1 (from ep_pair_rows); a token with no rows gets zeros.
// One block per token (grid-stride), threads over H.
extern "C" __global__ void ep_weighted_combine(const in_t* __restrict__ y,
                                               const int* __restrict__ rows,
                                               const float* __restrict__ w, int T, int H,
                                               out_t* __restrict__ out) {
    for (u64 t = blockIdx.x; t < (u64)T; t += gridDim.x) {
        int r[TOPK];
        float wk[TOPK];
#pragma unroll
        for (int k = 0; k < TOPK; ++k) {
            r[k] = rows[t * TOPK + k];
            wk[k] = w[t * TOPK + k];
        }
        for (u64 h = threadIdx.x; h < (u64)H; h += blockDim.x) {
            float acc = 0.0f;
#pragma unroll
            for (int k = 0; k < TOPK; ++k)
                if (r[k] >= 0)
                    acc = __fadd_rn(acc, __fmul_rn(wk[k], ep_load_in(y, (u64)r[k] * H + h)));
            out[t * H + h] = ep_to_out(acc);
        }
    }
}

// On the source, unweighted sum over ranks in rank order 0..R-1: TOKEN_MAJOR / RANK_MAJOR
// (rows already reduced over each rank's experts; row of (r, t) = send_pos[r*T + t] when
// rank_flag[r*T + t], i.e. the dispatch send order) and REPLICATED's reduce-scatter
// (rank_flag = send_pos = NULL: row of (r, t) = r*T + t).
extern "C" __global__ void ep_sum_ranks(const in_t* __restrict__ y,
                                        const int* __restrict__ rank_flag,
                                        const int* __restrict__ send_pos, int T, int R, int H,
                                        out_t* __restrict__ out) {
    for (u64 t = blockIdx.x; t < (u64)T; t += gridDim.x) {
        for (u64 h = threadIdx.x; h < (u64)H; h += blockDim.x) {
            float acc = 0.0f;
            for (int r = 0; r < R; ++r) {
                const u64 i = (u64)r * (u64)T + t;
                if (rank_flag && !rank_flag[i]) continue;
                const u64 row = send_pos ? (u64)send_pos[i] : i;
                acc = __fadd_rn(acc, ep_load_in(y, row * H + h));
            }
            out[t * H + h] = ep_to_out(acc);
        }
    }
}
