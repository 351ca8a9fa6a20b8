// scan: exclusive prefix sums of int32 with the total appended: out[0..=n], out[n] = sum.
// One block scans a tile of SCAN_TILE elements. For n > SCAN_TILE the host runs
//   ep_scan_block(in, out, n, sums)        -- tiles, block totals into sums[num_tiles]
//   (scan sums the same way into offsets[num_tiles + 1], recursively if needed)
//   ep_scan_add(out, n, offsets)           -- adds each tile's offset
// in == out is allowed (each thread reads its items before writing them back).
#define SCAN_THREADS 256
#define SCAN_ITEMS 4
#define SCAN_TILE (SCAN_THREADS * SCAN_ITEMS)

extern "C" __global__ void __launch_bounds__(SCAN_THREADS)
    ep_scan_block(const int* in, int* out, u64 n, int* __restrict__ block_sums) {
    __shared__ int warp_sums[SCAN_THREADS / 32];
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const u64 base = (u64)blockIdx.x * SCAN_TILE + (u64)threadIdx.x * SCAN_ITEMS;
    int v[SCAN_ITEMS];
    int sum = 0;
#pragma unroll
    for (int i = 0; i < SCAN_ITEMS; ++i) {
        v[i] = (base + i < n) ? in[base + i] : 0;
        sum += v[i];
    }
    int x = sum;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        int y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= (u32)o) x += y;
    }
    if (lane == 31u) warp_sums[warp] = x;
    __syncthreads();
    if (warp == 0) {
        int w = lane < SCAN_THREADS / 32 ? warp_sums[lane] : 0;
        int wi = w;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            int y = __shfl_up_sync(0xffffffffu, wi, o);
            if (lane >= (u32)o) wi += y;
        }
        if (lane < SCAN_THREADS / 32) warp_sums[lane] = wi - w;
    }
    __syncthreads();
    int run = x - sum + warp_sums[warp];
#pragma unroll
    for (int i = 0; i < SCAN_ITEMS; ++i) {
        if (base + i < n) out[base + i] = run;
        run += v[i];
        // The thread holding element n-1 appends the (tile-local) total.
        if (base + i + 1 == n) out[n] = run;
    }
    if (n == 0 && blockIdx.x == 0 && threadIdx.x == 0) out[0] = 0;
    if (block_sums && threadIdx.x == SCAN_THREADS - 1) block_sums[blockIdx.x] = run;
}

// out[i] += offsets[tile of i] for i in [0, n]; out[n] belongs to the tile of element n-1.
extern "C" __global__ void ep_scan_add(int* __restrict__ out, u64 n,
                                       const int* __restrict__ offsets) {
    for (u64 i = ep_global_thread(); i <= n; i += ep_num_threads()) {
        u64 tile = (i == n && n > 0) ? (n - 1) / SCAN_TILE : i / SCAN_TILE;
        out[i] += offsets[tile];
    }
}
