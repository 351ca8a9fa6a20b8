// unpack: from the receive buffer into each layout (docs/design.md, section 3). Specialised by
// ID_DTYPE (the dtype of the output ids) and TOPK. The receive buffer holds N rows ordered by
// source rank, then source token: recv_rows [N, row_bytes], recv_ids int32 [N, TOPK] (full global
// ids), recv_w f32 [N, TOPK], recv_src int32 [N] (source token), recv_offsets int32 [R + 1] (rows
// of source s are [recv_offsets[s], recv_offsets[s+1])).

__device__ __forceinline__ int ep_source_of(const int* offsets, int R, int n) {
    int s = 0;
    while (s + 1 < R && offsets[s + 1] <= n) ++s;
    return s;
}

// TOKEN_MAJOR: one row per received row, same order. Ids not owned by `rank` become -1 and
// their weights 0. tokens_per_local_expert comes from ep_recv_flags (local_counts).
// out_rows may be NULL when the caller uses recv_rows in place.
extern "C" __global__ void ep_unpack_token_major(const u8* __restrict__ recv_rows,
                                                 const int* __restrict__ recv_ids,
                                                 const float* __restrict__ recv_w, int N,
                                                 u64 row_bytes, int E_local, int rank,
                                                 u8* __restrict__ out_rows,
                                                 id_t_* __restrict__ out_ids,
                                                 float* __restrict__ out_w) {
    const u32 lane = ep_lane();
    const int base = rank * E_local;
    for (u64 n = ep_global_warp(); n < (u64)N; n += ep_num_warps()) {
        if (out_rows) ep_copy_bytes(out_rows + n * row_bytes, recv_rows + n * row_bytes,
                                    row_bytes, lane, 32);
        if (lane < TOPK) {
            int v = recv_ids[n * TOPK + lane];
            bool own = v >= base && v < base + E_local;
            out_ids[n * TOPK + lane] = own ? (id_t_)v : (id_t_)-1;
            out_w[n * TOPK + lane] = own ? recv_w[n * TOPK + lane] : 0.0f;
        }
    }
}

// Shared by EXPERT_MAJOR and EXPERT_PACKED: one warp per (local expert j, row n) with
// expert_flag[j*N + n] set. expert_pos is the ep_scan of expert_flag ([E_local*N + 1]): grouped
// by j, then row order (= source rank, then token). capacity > 0: bucket slot
// pos - pos[j*N] of bucket j (overflow → error {CAPACITY, j, n}); capacity == 0: packed row pos.
__device__ __forceinline__ void ep_unpack_expert(
    const u8* __restrict__ recv_rows, const int* __restrict__ recv_ids,
    const float* __restrict__ recv_w, const int* __restrict__ recv_src,
    const int* __restrict__ recv_offsets, int N, int R, u64 row_bytes, int E_local, int rank,
    const int* __restrict__ expert_flag, const int* __restrict__ expert_pos, int capacity,
    u8* __restrict__ out_rows, float* __restrict__ out_w, int* __restrict__ out_src_rank,
    int* __restrict__ out_src_token, u64* err) {
    const u32 lane = ep_lane();
    const u64 total = (u64)E_local * (u64)N;
    for (u64 i = ep_global_warp(); i < total; i += ep_num_warps()) {
        if (!expert_flag[i]) continue;
        const u64 j = i / (u64)N, n = i % (u64)N;
        u64 dst;
        if (capacity > 0) {
            const u64 slot = (u64)(expert_pos[i] - expert_pos[j * (u64)N]);
            if (slot >= (u64)capacity) {
                if (lane == 0) ep_err_report(err, ep_err_make(EP_ERR_CAPACITY, (u32)n, (u32)j));
                continue;
            }
            dst = j * (u64)capacity + slot;
        } else {
            dst = (u64)expert_pos[i];
        }
        ep_copy_bytes(out_rows + dst * row_bytes, recv_rows + n * row_bytes, row_bytes, lane, 32);
        if (lane == 0) {
            const int e = rank * E_local + (int)j;
            float w = 0.0f;
#pragma unroll
            for (int k = 0; k < TOPK; ++k)
                if (recv_ids[n * TOPK + k] == e) w = recv_w[n * TOPK + k];
            if (out_w) out_w[dst] = w;
            if (out_src_rank) out_src_rank[dst] = ep_source_of(recv_offsets, R, (int)n);
            if (out_src_token) out_src_token[dst] = recv_src[n];
        }
    }
}

// EXPERT_MAJOR: buckets out_rows [E_local, capacity, row_bytes] (capacity = M*R), counts
// [E_local] int32. Per-slot weight/source outputs are optional (NULL to skip).
extern "C" __global__ void ep_unpack_expert_major(
    const u8* __restrict__ recv_rows, const int* __restrict__ recv_ids,
    const float* __restrict__ recv_w, const int* __restrict__ recv_src,
    const int* __restrict__ recv_offsets, int N, int R, u64 row_bytes, int E_local, int rank,
    const int* __restrict__ expert_flag, const int* __restrict__ expert_pos, int capacity,
    u8* __restrict__ out_rows, int* __restrict__ counts, float* __restrict__ out_w,
    int* __restrict__ out_src_rank, int* __restrict__ out_src_token, u64* err) {
    for (u64 j = ep_global_thread(); j < (u64)E_local; j += ep_num_threads())
        counts[j] = expert_pos[(j + 1) * (u64)N] - expert_pos[j * (u64)N];
    ep_unpack_expert(recv_rows, recv_ids, recv_w, recv_src, recv_offsets, N, R, row_bytes,
                     E_local, rank, expert_flag, expert_pos, capacity > 0 ? capacity : 1,
                     out_rows, out_w, out_src_rank, out_src_token, err);
}

// EXPERT_PACKED: out_rows [N_rows, row_bytes] grouped by expert (N_rows = expert_pos[E_local*N]),
// expert_offsets [E_local + 1], per-row routing weight and source (rank, token).
extern "C" __global__ void ep_unpack_expert_packed(
    const u8* __restrict__ recv_rows, const int* __restrict__ recv_ids,
    const float* __restrict__ recv_w, const int* __restrict__ recv_src,
    const int* __restrict__ recv_offsets, int N, int R, u64 row_bytes, int E_local, int rank,
    const int* __restrict__ expert_flag, const int* __restrict__ expert_pos,
    u8* __restrict__ out_rows, int* __restrict__ expert_offsets, float* __restrict__ out_w,
    int* __restrict__ out_src_rank, int* __restrict__ out_src_token) {
    for (u64 j = ep_global_thread(); j <= (u64)E_local; j += ep_num_threads())
        expert_offsets[j] = expert_pos[j * (u64)N];
    ep_unpack_expert(recv_rows, recv_ids, recv_w, recv_src, recv_offsets, N, R, row_bytes,
                     E_local, rank, expert_flag, expert_pos, 0, out_rows, out_w, out_src_rank,
                     out_src_token, 0);
}

// RANK_MAJOR: out_rows [R, M, row_bytes]; region s holds source s's rows in token order with
// full ids/weights; slots past recv_counts[s] get ids -1 and weights 0 (row bytes untouched).
// More than M rows from one source → error {RANK_CAPACITY, s, count}.
extern "C" __global__ void ep_unpack_rank_major(const u8* __restrict__ recv_rows,
                                                const int* __restrict__ recv_ids,
                                                const float* __restrict__ recv_w,
                                                const int* __restrict__ recv_offsets, int R,
                                                int M, u64 row_bytes, u8* __restrict__ out_rows,
                                                id_t_* __restrict__ out_ids,
                                                float* __restrict__ out_w,
                                                int* __restrict__ recv_counts, u64* err) {
    const u32 lane = ep_lane();
    const u64 total = (u64)R * (u64)M;
    for (u64 i = ep_global_warp(); i < total; i += ep_num_warps()) {
        const u64 s = i / (u64)M, m = i % (u64)M;
        const int cnt = recv_offsets[s + 1] - recv_offsets[s];
        if (m == 0 && lane == 0) {
            recv_counts[s] = cnt < M ? cnt : M;
            if (cnt > M) ep_err_report(err, ep_err_make(EP_ERR_RANK_CAPACITY, (u32)s, (u32)cnt));
        }
        if (m < (u64)cnt) {
            const u64 n = (u64)recv_offsets[s] + m;
            ep_copy_bytes(out_rows + i * row_bytes, recv_rows + n * row_bytes, row_bytes, lane, 32);
            if (lane < TOPK) {
                out_ids[i * TOPK + lane] = (id_t_)recv_ids[n * TOPK + lane];
                out_w[i * TOPK + lane] = recv_w[n * TOPK + lane];
            }
        } else if (lane < TOPK) {
            out_ids[i * TOPK + lane] = (id_t_)-1;
            out_w[i * TOPK + lane] = 0.0f;
        }
    }
}
