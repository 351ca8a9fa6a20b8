// layout: routing metadata from topk_ids, on the sender and on the receiver.
// Specialised by ID_DTYPE and TOPK. Positions come from ep_scan over 0/1 flags laid out so that
// the scan order IS the wire order, so no atomic ever decides where a row goes.

// Sender. One thread per token t (grid-stride). Writes, for every destination rank r:
//   rank_flag[r*T + t]            = 1 if any id of t is owned by r (owner(e) = e / E_local)
//   pair_flag[(r*T + t)*TOPK + k] = 1 if id k of t is owned by r          (nullable)
// rank_counts[r] += 1 per token going to r; expert_counts[e] += 1 per (token, e) — the EPLB
// load histogram (both nullable, zeroed by the caller; integer sums, so order-independent).
// Bad tokens (id < -1 or >= E, or a duplicate id) are reported in *err as {code, t, k} and
// routed nowhere; the host checks *err before using anything else.
extern "C" __global__ void ep_layout(const id_t_* __restrict__ topk_ids, int T, int E, int E_local,
                                     int R, int* __restrict__ rank_flag,
                                     int* __restrict__ pair_flag, int* __restrict__ rank_counts,
                                     int* __restrict__ expert_counts, u64* err) {
    for (u64 t = ep_global_thread(); t < (u64)T; t += ep_num_threads()) {
        int ids[TOPK];
        bool bad = false;
#pragma unroll
        for (int k = 0; k < TOPK; ++k) {
            id_t_ v = topk_ids[t * TOPK + k];
            if (v < -1 || v >= (id_t_)E) {
                ep_err_report(err, ep_err_make(EP_ERR_ID_OUT_OF_RANGE, (u32)t, (u32)k));
                bad = true;
                ids[k] = -1;
            } else {
                ids[k] = (int)v;
            }
        }
#pragma unroll
        for (int k = 1; k < TOPK; ++k) {
#pragma unroll
            for (int k2 = 0; k2 < k; ++k2) {
                if (ids[k] >= 0 && ids[k] == ids[k2]) {
                    ep_err_report(err, ep_err_make(EP_ERR_DUPLICATE_ID, (u32)t, (u32)k));
                    bad = true;
                }
            }
        }
        int owner[TOPK];
#pragma unroll
        for (int k = 0; k < TOPK; ++k) owner[k] = (!bad && ids[k] >= 0) ? ids[k] / E_local : -1;
        for (int r = 0; r < R; ++r) {
            int f = 0;
            u64 i = (u64)r * (u64)T + t;
#pragma unroll
            for (int k = 0; k < TOPK; ++k) {
                int p = owner[k] == r;
                f |= p;
                if (pair_flag) pair_flag[i * TOPK + k] = p;
            }
            rank_flag[i] = f;
            if (f && rank_counts) atomicAdd(&rank_counts[r], 1);
        }
        if (!bad && expert_counts) {
#pragma unroll
            for (int k = 0; k < TOPK; ++k)
                if (ids[k] >= 0) atomicAdd(&expert_counts[ids[k]], 1);
        }
    }
}

// Sender, before weighted_combine: rows[t*TOPK + k] = the row of (t, k) in the combine receive
// buffer (ordered by expert-owning rank, then t, then k) = pair_pos[(owner*T + t)*TOPK + k],
// or -1 for a masked id. pair_pos is the ep_scan of ep_layout's pair_flag. An id outside
// [0, E) also gets -1: capacity mode runs this before anyone reads the error word, and such
// an id's owner would index pair_pos (and then the receive buffer) out of bounds.
extern "C" __global__ void ep_pair_rows(const id_t_* __restrict__ topk_ids, int T, int E,
                                        int E_local, const int* __restrict__ pair_pos,
                                        int* __restrict__ rows) {
    for (u64 i = ep_global_thread(); i < (u64)T * TOPK; i += ep_num_threads()) {
        id_t_ v = topk_ids[i];
        int row = -1;
        if (v >= 0 && v < (id_t_)E) {
            u64 t = i / TOPK, k = i % TOPK;
            u64 owner = (u64)(v / E_local);
            row = pair_pos[(owner * (u64)T + t) * TOPK + k];
        }
        rows[i] = row;
    }
}

// Receiver (rank `rank`), from the received wire ids (int32 [N, TOPK], rows ordered by source
// rank then token). One thread per row n:
//   expert_flag[j*N + n] = 1 if row n routes to local expert j            (nullable)
//   pair_flag[n*TOPK + k] = 1 if id k of row n is owned by this rank      (nullable)
//   local_counts[j] += 1 per row routing to local expert j (TOKEN_MAJOR's
//   tokens_per_local_expert; nullable, zeroed by the caller)
extern "C" __global__ void ep_recv_flags(const int* __restrict__ recv_ids, int N, int E_local,
                                         int rank, int* __restrict__ expert_flag,
                                         int* __restrict__ pair_flag,
                                         int* __restrict__ local_counts) {
    int base = rank * E_local;
    for (u64 n = ep_global_thread(); n < (u64)N; n += ep_num_threads()) {
        int local[TOPK];
#pragma unroll
        for (int k = 0; k < TOPK; ++k) {
            int v = recv_ids[n * TOPK + k];
            local[k] = (v >= base && v < base + E_local) ? v - base : -1;
            if (pair_flag) pair_flag[n * TOPK + k] = local[k] >= 0;
            if (local[k] >= 0 && local_counts) atomicAdd(&local_counts[local[k]], 1);
        }
        if (expert_flag) {
            for (int j = 0; j < E_local; ++j) {
                int f = 0;
#pragma unroll
                for (int k = 0; k < TOPK; ++k) f |= local[k] == j;
                expert_flag[(u64)j * (u64)N + n] = f;
            }
        }
    }
}
