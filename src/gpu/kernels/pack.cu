// pack: rows into a send buffer grouped by destination rank; local_copy for self traffic and
// all-gathers. Specialised by ID_DTYPE and TOPK. Rows move as bytes (any dtype).

// One warp per (r, t) with rank_flag[r*T + t] set: row t goes to send row send_pos[r*T + t]
// (the ep_scan of rank_flag: grouped by r, then t). Also writes the wire metadata per send
// row: ids as int32 (all TOPK ids, unchanged), weights, and the source token index. The
// metadata pointers are nullable so the same kernel packs extra payloads (e.g. scales [T, S]:
// rows = scales, row_bytes = S * 4, everything else NULL).
extern "C" __global__ void ep_pack(const u8* __restrict__ rows, u64 row_bytes,
                                   const id_t_* __restrict__ topk_ids,
                                   const float* __restrict__ topk_weights, int T, int R,
                                   const int* __restrict__ rank_flag,
                                   const int* __restrict__ send_pos, u8* __restrict__ send_rows,
                                   int* __restrict__ send_ids, float* __restrict__ send_weights,
                                   int* __restrict__ send_src) {
    const u32 lane = ep_lane();
    const u64 total = (u64)T * (u64)R;
    for (u64 i = ep_global_warp(); i < total; i += ep_num_warps()) {
        if (!rank_flag[i]) continue;
        const u64 t = i % (u64)T;
        const u64 dst = (u64)send_pos[i];
        ep_copy_bytes(send_rows + dst * row_bytes, rows + t * row_bytes, row_bytes, lane, 32);
        if (lane < TOPK) {
            if (send_ids) send_ids[dst * TOPK + lane] = (int)topk_ids[t * TOPK + lane];
            if (send_weights) send_weights[dst * TOPK + lane] = topk_weights[t * TOPK + lane];
        }
        if (lane == 0 && send_src) send_src[dst] = (int)t;
    }
}

// Copies `bytes` from src to dst with the whole grid (16-byte vectors when aligned): the self
// block of dispatch/combine, and REPLICATED's all-gather, which is a pure copy.
extern "C" __global__ void ep_local_copy(u8* __restrict__ dst, const u8* __restrict__ src,
                                         u64 bytes) {
    ep_copy_bytes(dst, src, bytes, (u32)ep_global_thread(), (u32)ep_num_threads());
}
