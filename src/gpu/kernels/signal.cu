// signal / wait for the one-sided transport. Epochs live in device memory and only move forward
// (bumped by ep_epoch_bump once per round; 0 is skipped on wraparound because a zeroed flag
// means "never signalled"), so CUDA-graph replays stay correct. Sender: data, then
// fence.acq_rel.sys, then st.release.sys of the epoch into the peer's flag slot. Receiver:
// ld.acquire.sys spin bounded by %globaltimer; on timeout it writes {WAIT_TIMEOUT, peer} into
// the error word (the prelude's 64-bit word, decoded by kernels.rs::decode_error_word and
// onesided::ErrorWord) and returns (no trap: the context survives and the host reports the
// peer). The epoch rules are onesided::Epoch::next and onesided::epoch_reached, checked against
// this file in the host emulation (tests/gpu_host.rs).

__device__ __forceinline__ void ep_st_release_sys(u32* p, u32 v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ u32 ep_ld_acquire_sys(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void ep_fence_acq_rel_sys() {
    asm volatile("fence.acq_rel.sys;" ::: "memory");
}
__device__ __forceinline__ u64 ep_globaltimer() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ void ep_nanosleep() { asm volatile("nanosleep.u32 64;"); }

// ---- portable part (the host emulation replaces the inline-PTX helpers above)

// The epoch after `e`: 1, 2, ..., 0xffffffff, 1, ... (never 0).
__device__ __forceinline__ u32 ep_epoch_next(u32 e) { return e == 0xffffffffu ? 1u : e + 1u; }

// Whether a flag holding `flag` shows epoch `want` (or a later one): serial-number compare
// (the ranks are never 2^31 epochs apart); a zero flag was never signalled and never counts.
__device__ __forceinline__ bool ep_epoch_reached(u32 flag, u32 want) {
    return flag != 0u && (int)(flag - want) >= 0;
}

// epoch[0] = next epoch (one thread). Launch once per round on each rank before signalling.
extern "C" __global__ void ep_epoch_bump(u32* epoch) {
    if (blockIdx.x == 0 && threadIdx.x == 0) epoch[0] = ep_epoch_next(epoch[0]);
}

// Thread r < R stores *epoch into *peer_flags[r] (a device address in peer r's mapped
// workspace: its flag slot for this source rank). Everything this rank wrote before (earlier
// kernels in the stream, or this grid's earlier writes) is visible to r once it sees the flag.
extern "C" __global__ void ep_signal(const u64* __restrict__ peer_flags, int R,
                                     const u32* __restrict__ epoch) {
    const u64 r = ep_global_thread();
    if (r >= (u64)R || peer_flags[r] == 0ull) return;
    const u32 e = epoch[0];
    ep_fence_acq_rel_sys();
    ep_st_release_sys((u32*)peer_flags[r], e);
}

// Thread r < R waits until flags[r] (this rank's slot written by source r) reaches *epoch
// (ep_epoch_reached). Gives up after timeout_ns (→ error {WAIT_TIMEOUT, r, 0}) or as soon as
// another thread has reported an error, so one dead peer does not cost R timeouts.
extern "C" __global__ void ep_wait(const u32* flags, int R, const u32* __restrict__ epoch,
                                   u64 timeout_ns, u64* err) {
    const u64 r = ep_global_thread();
    if (r >= (u64)R) return;
    const u32 e = epoch[0];
    const u64 deadline = ep_globaltimer() + timeout_ns;
    for (;;) {
        if (ep_epoch_reached(ep_ld_acquire_sys(flags + r), e)) return;
        if (ep_globaltimer() > deadline) {
            ep_err_report(err, ep_err_make(EP_ERR_WAIT_TIMEOUT, (u32)r, 0u));
            return;
        }
        if (err && *((volatile u64*)err) != 0ull) return;
        ep_nanosleep();
    }
}
