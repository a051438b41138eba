// Matrix multiplication in the steps of chapters 11-12: naive, shared-memory tiles, register
// tiles (fp32), then tensor cores (bf16): mma.sync + ldmatrix fed by cp.async; then, going faster
// on Hopper, the same kernel fed by TMA, and wgmma.
// Build: make -C csrc; run: csrc/build/matmul [--check].
#include "common.cuh"
#include "harness.cuh"

// ---- BEGIN KERNELS ----
#include <cuda.h>          // CUtensorMap, for TMA (steps 4 and 5)
#include <cudaTypedefs.h>  // the type of the driver's cuTensorMapEncodeTiled
// C = A @ B for row-major A (M, K), B (K, N) and C (M, N), any M, N, K: every load outside the
// matrices reads zero and every store outside them is skipped. Each step below does the same
// 2 M N K FLOPs; what changes is how often each input byte is fetched, and from where.

// Step 1, naive: one thread per element of C computes a dot product straight from global
// memory, two 4-byte loads per FMA (0.25 FLOP per byte loaded). The threads of a warp take
// consecutive columns, so their B loads coalesce and their A load is a single broadcast, but every
// element of A is fetched N times and every element of B M times; L2 absorbs most of it, and the
// load units still cap the kernel at a few TFLOP/s.
__global__ void matmul_naive_kernel(const float* A, const float* B, float* C, int M, int N, int K) {
    const int col = blockIdx.x * blockDim.x + threadIdx.x;
    const int row = blockIdx.y * blockDim.y + threadIdx.y;
    if (row >= M || col >= N) return;
    float acc = 0.0f;
    for (int k = 0; k < K; ++k) acc += A[static_cast<size_t>(row) * K + k] * B[static_cast<size_t>(k) * N + col];
    C[static_cast<size_t>(row) * N + col] = acc;
}

// Step 2, shared-memory tiles: a 32x32 block of threads stages a 32x32 tile of A and one of B in
// shared memory, one element per thread, then each thread runs 32 FMAs out of shared memory.
// Every global element is now fetched 32x less often; the limit moves to shared memory, two
// loads per FMA. As[ty][k] is one address per warp (a broadcast) and Bs[k][tx] 32 consecutive
// words (32 banks): no bank conflicts.
constexpr int TILE = 32;

__global__ void matmul_tiled_kernel(const float* A, const float* B, float* C, int M, int N, int K) {
    __shared__ float As[TILE][TILE];
    __shared__ float Bs[TILE][TILE];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int row = blockIdx.y * TILE + ty, col = blockIdx.x * TILE + tx;
    float acc = 0.0f;
    for (int k0 = 0; k0 < K; k0 += TILE) {
        As[ty][tx] = row < M && k0 + tx < K ? A[static_cast<size_t>(row) * K + k0 + tx] : 0.0f;
        Bs[ty][tx] = k0 + ty < K && col < N ? B[static_cast<size_t>(k0 + ty) * N + col] : 0.0f;
        __syncthreads();  // the tiles are complete before anyone reads them
#pragma unroll
        for (int k = 0; k < TILE; ++k) acc += As[ty][k] * Bs[k][tx];
        __syncthreads();  // everyone is done with the tiles before they are overwritten
    }
    if (row < M && col < N) C[static_cast<size_t>(row) * N + col] = acc;
}

// Step 3, register tiles: a block of 256 threads computes a 128x128 tile of C, each thread an
// 8x8 sub-tile held in 64 registers. Per k, a thread loads 8 values of A and 8 of B from shared
// memory (four 16-byte loads) and does 64 FMAs with them: 16 FMAs per shared-memory
// instruction instead of 0.5. The A tile is stored transposed (As[k][m]), so a thread's 8 A
// values for one k are contiguous. A thread's rows are 4ty..4ty+3 and 64+4ty..64+4ty+3 (columns
// likewise): the 16 threads of a half-warp then read 256 contiguous bytes of Bs, the minimum two
// shared-memory wavefronts. Double buffering: the next k-tile is loaded from global memory into
// registers while the FMAs run on the current one, then stored to the other shared buffer, so
// there is one barrier per k-tile and the load latency hides behind arithmetic.
constexpr int RT_BM = 128, RT_BN = 128, RT_BK = 16;  // block tile of C, and the k-step
constexpr int RT_THREADS = 256;                      // 16 x 16 threads, 8 x 8 outputs each
constexpr int RT_PAD = 4;  // pads As rows by a float4: the transposed stores collide 2-way, not 4-way

// p[row][col .. col+3] of a rows x cols row-major matrix, zeros outside it. VEC: one 16-byte load
// (needs cols % 4 == 0 and a 16-byte-aligned p, so the four are all inside or all outside).
template <bool VEC>
__device__ __forceinline__ float4 load_float4(const float* p, int row, int col, int rows, int cols) {
    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (row >= rows) return v;
    const float* q = p + static_cast<size_t>(row) * cols + col;
    if (VEC) {
        if (col < cols) v = *reinterpret_cast<const float4*>(q);
    } else {
        if (col < cols) v.x = q[0];
        if (col + 1 < cols) v.y = q[1];
        if (col + 2 < cols) v.z = q[2];
        if (col + 3 < cols) v.w = q[3];
    }
    return v;
}

// bias (N floats) may be null; it is added to every row of C.
template <bool VEC>
__global__ void __launch_bounds__(RT_THREADS, 2)
    matmul_register_tiled_kernel(const float* A, const float* B, const float* bias, float* C, int M, int N, int K) {
    __shared__ __align__(16) float As[2][RT_BK][RT_BM + RT_PAD];  // A tile, transposed: As[k][m]
    __shared__ __align__(16) float Bs[2][RT_BK][RT_BN];
    const int tid = threadIdx.x;
    const int row0 = blockIdx.y * RT_BM, col0 = blockIdx.x * RT_BN;

    // Staging: the A tile (128 x 16) is 512 float4, two per thread (rows a_row and a_row + 64,
    // k a_k..a_k+3); the B tile (16 x 128) too (k rows b_k and b_k + 8, columns b_col..b_col+3).
    const int a_row = tid / 4, a_k = 4 * (tid % 4);
    const int b_k = tid / 32, b_col = 4 * (tid % 32);
    float4 a_next[2], b_next[2];
    auto load_tile = [&](int k0) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            a_next[h] = load_float4<VEC>(A, row0 + a_row + 64 * h, k0 + a_k, M, K);
            b_next[h] = load_float4<VEC>(B, k0 + b_k + 8 * h, col0 + b_col, K, N);
        }
    };
    auto store_tile = [&](int buf) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int m = a_row + 64 * h;
            As[buf][a_k + 0][m] = a_next[h].x;
            As[buf][a_k + 1][m] = a_next[h].y;
            As[buf][a_k + 2][m] = a_next[h].z;
            As[buf][a_k + 3][m] = a_next[h].w;
            *reinterpret_cast<float4*>(&Bs[buf][b_k + 8 * h][b_col]) = b_next[h];
        }
    };

    const int ty = tid / 16, tx = tid % 16;
    float acc[8][8] = {};
    const int k_tiles = static_cast<int>(ceil_div(K, RT_BK));
    load_tile(0);
    store_tile(0);
    __syncthreads();
    for (int t = 0; t < k_tiles; ++t) {
        const int buf = t % 2;
        if (t + 1 < k_tiles) load_tile((t + 1) * RT_BK);  // in flight during the FMAs below
#pragma unroll
        for (int k = 0; k < RT_BK; ++k) {
            const float4 a0 = *reinterpret_cast<const float4*>(&As[buf][k][4 * ty]);
            const float4 a1 = *reinterpret_cast<const float4*>(&As[buf][k][64 + 4 * ty]);
            const float4 b0 = *reinterpret_cast<const float4*>(&Bs[buf][k][4 * tx]);
            const float4 b1 = *reinterpret_cast<const float4*>(&Bs[buf][k][64 + 4 * tx]);
            const float a[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
            const float b[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
            for (int i = 0; i < 8; ++i)
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        // the other buffer was last read in iteration t - 1, before the barrier that ended it
        if (t + 1 < k_tiles) store_tile(buf ^ 1);
        __syncthreads();
    }

#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int row = row0 + (i < 4 ? 4 * ty + i : 64 + 4 * ty + i - 4);
        if (row >= M) continue;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int col = col0 + 64 * h + 4 * tx;
            float v[4] = {acc[i][4 * h], acc[i][4 * h + 1], acc[i][4 * h + 2], acc[i][4 * h + 3]};
            float* out = C + static_cast<size_t>(row) * N + col;
#pragma unroll
            for (int j = 0; j < 4; ++j)
                if (bias != nullptr && col + j < N) v[j] += bias[col + j];
            if (VEC) {
                if (col < N) *reinterpret_cast<float4*>(out) = make_float4(v[0], v[1], v[2], v[3]);
            } else {
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    if (col + j < N) out[j] = v[j];
            }
        }
    }
}

// Step 4, tensor cores (bf16 in, fp32 accumulate, bf16 out). One mma.sync.m16n8k16 instruction
// is a warp-wide 16x8x16 product, 4096 FLOPs, where an FFMA is 64 per warp. Feeding it is now
// the whole job:
//  - A ring of 3 shared-memory stages keeps two k-tiles in flight while the tensor cores work
//    on a third. cp.async (sm_80 and newer) fills it: every thread copies its share of 16-byte
//    chunks global -> shared, with no register round trip, and waits for its own copies. (The
//    template argument TMA swaps in Hopper's copy engine: "Going faster on Hopper", below.)
//  - ldmatrix loads a warp's operand fragments from shared memory in the exact register layout
//    mma expects (.trans transposes B, stored k-major, on the way); the fragments of the next
//    k-step of 16 are loaded while the mma of this one run.
//  - Shared tiles are rows of 64 bf16 (128 bytes), 16-byte chunk c of row r stored at
//    c ^ (r % 8) (an XOR swizzle, the same as TMA's 128-byte mode): the 8 rows one ldmatrix reads
//    then sit in 8 different bank groups instead of one. A's tile is 128 such rows; B's 64x256
//    tile is 4 panels of 64 columns.
//  - A block computes a 128x256 tile of C with 8 warps, each a 64x64 tile: per k-step of 16 a
//    warp loads 4 A and 8 B fragments with 8 ldmatrix and issues 32 mma.
//  - Blocks walk the tiles in groups of 8 block-rows (grouped_tile below).
// At 4096^3 on the H200 this kernel runs at about 0.4x cuBLAS.
// Needs K % 8 == 0, N % 8 == 0 and 16-byte-aligned A and B (whole 16-byte chunks per row, and
// TMA's rule for strides and addresses); M is free. Needs sm_80 or newer.
constexpr int TC_BM = 128, TC_BN = 256, TC_BK = 64;  // block tile of C, and the k-step (one 128-byte row)
constexpr int TC_STAGES = 3;                         // depth of the ring
constexpr int TC_THREADS = 256;                      // 8 warps: 2 (m) x 4 (n), 64 x 64 of C each
constexpr int TC_A_BYTES = TC_BM * TC_BK * 2, TC_PANEL_BYTES = TC_BK * 64 * 2;  // A's tile; one panel of B's
constexpr int TC_STAGE_BYTES = TC_A_BYTES + TC_BK * TC_BN * 2;
constexpr int TC_SMEM_BYTES = TC_STAGES * TC_STAGE_BYTES + 1024;  // 145 KB (+ room to align the ring to 1024)

// Blocks walk the tiles of C in groups of 8 block-rows (Triton's grouped ordering): block b's
// tile (row0, col0), going down a group's 8 block-rows before the next column, so the A rows and
// B columns that neighbouring blocks share are still in L2.
// (block is unsigned, as blockIdx.x is: the divisions by group stay unsigned, which take fewer
// instructions than signed ones.)
__device__ __forceinline__ int2 grouped_tile(unsigned block, int M, int N, int BM, int BN) {
    const int grid_m = static_cast<int>(ceil_div(M, BM)), grid_n = static_cast<int>(ceil_div(N, BN));
    const int group = 8 * grid_n, first_m = block / group * 8, group_m = min(grid_m - first_m, 8);
    return make_int2((first_m + block % group % group_m) * BM, block % group / group_m * BN);
}

// 16 bytes global -> shared, asynchronously; src_bytes 0 (pred false) writes zeros instead.
__device__ __forceinline__ void cp_async_16(uint32_t smem_addr, const void* gmem, bool pred) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr), "l"(gmem), "r"(pred ? 16 : 0)
                 : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Wait until at most `pending` of this thread's committed groups are still in flight.
template <int pending>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(pending) : "memory");
}

// Four 8x8 bf16 matrices: lane l gives the address of row l % 8 of matrix l / 8 and receives,
// in r[j], two elements of matrix j (row l / 4, columns 2 (l % 4) and +1); .trans transposes.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t smem_addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr)
                 : "memory");
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t smem_addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr)
                 : "memory");
}

// d (16x8 fp32) += a (16x16 bf16, row-major fragment) * b (16x8 bf16, column-major fragment).
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Byte offset of 16-byte chunk `chunk` (0-7) of row `row` in a tile of 128-byte rows.
__device__ __forceinline__ uint32_t swizzled(int row, int chunk) {
    return static_cast<uint32_t>(row * 8 + (chunk ^ (row % 8))) * 16;
}

// The primitives of the Hopper feed, used only when the kernel's template argument TMA is true
// ("Going faster on Hopper", below, says what they buy).
// TMA and mbarriers exist from sm_90 on; built for an older GPU these compile to nothing, and
// the launchers never pick the TMA kernels there.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define HAS_TMA 1
#endif

// An mbarrier is a 64-bit shared-memory word that counts arrivals and, for TMA, bytes. Each
// stage of a ring has one, used over and over: use u of it completes phase u, whose parity
// (u % 2) is what a waiter names.
__device__ __forceinline__ void mbarrier_init(uint32_t bar0, int count) {  // `count` barriers, one arrival each
#ifdef HAS_TMA
    if (threadIdx.x == 0) {
        for (int s = 0; s < count; ++s)
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bar0 + 8 * s) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");  // visible to the TMA unit
    }
#endif
    __syncthreads();
}

// The one arrival, which also announces `bytes` of TMA writes still to come: the phase
// completes when they have all landed.
__device__ __forceinline__ void mbarrier_expect_bytes(uint32_t bar, int bytes) {
#ifdef HAS_TMA
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
#endif
}

__device__ __forceinline__ void mbarrier_wait(uint32_t bar, int parity) {
#ifdef HAS_TMA
    uint32_t done = 0;
    while (!done)
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
#endif
}

// The box at coordinates (x = column, y = row) of the matrix `map` describes -> shared memory
// at dst, swizzled as the map says; elements outside the matrix arrive as zeros, and all the
// box's bytes count on the barrier.
__device__ __forceinline__ void tma_load_box(uint32_t dst, const CUtensorMap* map, int x, int y, uint32_t bar) {
#ifdef HAS_TMA
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
        "[%4];\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(bar)
        : "memory");
#endif
}

// With TMA the tensor maps describe A and B (the pointers are unused), without it the pointers
// are read. bias (N values) may be null; it is added to every row of C before the rounding to bf16.
template <bool TMA>
__global__ void __launch_bounds__(TC_THREADS, 1)
    matmul_tensor_core_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                              const __nv_bfloat16* A, const __nv_bfloat16* B, const __nv_bfloat16* bias,
                              __nv_bfloat16* C, int M, int N, int K) {
    extern __shared__ float4 dynamic_smem[];
    __shared__ alignas(8) uint64_t landed[TC_STAGES];  // TMA: one mbarrier a stage, complete when its tiles are in
    const uint32_t smem = (static_cast<uint32_t>(__cvta_generic_to_shared(dynamic_smem)) + 1023) & ~1023u;
    const uint32_t bar0 = static_cast<uint32_t>(__cvta_generic_to_shared(landed));

    const int2 tile = grouped_tile(blockIdx.x, M, N, TC_BM, TC_BN);
    const int row0 = tile.x, col0 = tile.y;

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int warp_row = warp / 4 * 64, warp_col = warp % 4 * 64;  // this warp's 64x64 of the tile
    if (TMA) mbarrier_init(bar0, TC_STAGES);

    // Stage s holds the A tile (128 rows x 8 chunks), then B's 4 panels (64 rows x 8 chunks each).
    auto load_stage = [&](int stage, int k0) {
        const uint32_t a_tile = smem + stage * TC_STAGE_BYTES, b_tile = a_tile + TC_A_BYTES;
        if constexpr (TMA) {
            if (tid == 0) {
                const uint32_t bar = bar0 + 8 * stage;
                mbarrier_expect_bytes(bar, TC_STAGE_BYTES);
                tma_load_box(a_tile, &map_a, k0, row0, bar);
#pragma unroll
                for (int p = 0; p < TC_BN / 64; ++p)
                    tma_load_box(b_tile + p * TC_PANEL_BYTES, &map_b, col0 + 64 * p, k0, bar);
            }
        } else {
#pragma unroll
            for (int i = 0; i < TC_BM * TC_BK / 8 / TC_THREADS; ++i) {
                const int id = tid + i * TC_THREADS, r = id / 8, c = id % 8;
                const bool inside = row0 + r < M && k0 + 8 * c < K;
                const __nv_bfloat16* src = inside ? A + static_cast<size_t>(row0 + r) * K + k0 + 8 * c : A;
                cp_async_16(a_tile + swizzled(r, c), src, inside);
            }
#pragma unroll
            for (int i = 0; i < TC_BK * TC_BN / 8 / TC_THREADS; ++i) {
                const int id = tid + i * TC_THREADS, r = id / 32, c = id % 32;  // chunk c of the 256 columns
                const bool inside = k0 + r < K && col0 + 8 * c < N;
                const __nv_bfloat16* src = inside ? B + static_cast<size_t>(k0 + r) * N + col0 + 8 * c : B;
                cp_async_16(b_tile + c / 8 * TC_PANEL_BYTES + swizzled(r, c % 8), src, inside);
            }
        }
    };

    float acc[4][8][4] = {};  // [16-row slice][8-column slice][mma accumulator fragment]
    const int k_tiles = static_cast<int>(ceil_div(K, TC_BK));
#pragma unroll
    for (int s = 0; s < TC_STAGES - 1; ++s) {
        if (s < k_tiles) load_stage(s, s * TC_BK);
        if (!TMA) cp_async_commit();  // empty groups too, so that every thread counts the same groups
    }
    for (int t = 0; t < k_tiles; ++t) {
        if (TMA)
            mbarrier_wait(bar0 + 8 * (t % TC_STAGES), t / TC_STAGES % 2);  // tile t has landed
        else
            cp_async_wait<TC_STAGES - 2>();  // this thread's copies of tile t have landed
        __syncthreads();                     // everyone's have, and everyone is done with tile t - 1
        const int next = t + TC_STAGES - 1;
        if (next < k_tiles) load_stage(next % TC_STAGES, next * TC_BK);  // refills tile t - 1's stage
        if (!TMA) cp_async_commit();

        const uint32_t a_tile = smem + (t % TC_STAGES) * TC_STAGE_BYTES, b_tile = a_tile + TC_A_BYTES;
        uint32_t a[2][4][4], b[2][8][2];  // two sets of fragments: k-step kk + 1's load while kk's mma run
        auto load_fragments = [&](int set, int kk) {
#pragma unroll
            for (int mi = 0; mi < 4; ++mi) {
                // matrices: rows 0-7 / 8-15 of the slice (lanes 0-15) at k 0-7, then at k 8-15 (lanes 16-31)
                const int r = warp_row + 16 * mi + lane % 16, c = 2 * kk + lane / 16;
                ldmatrix_x4(a[set][mi], a_tile + swizzled(r, c));
            }
#pragma unroll
            for (int nj = 0; nj < 4; ++nj) {
                // matrices: k 0-7 / 8-15 (lanes 0-7 / 8-15) of columns 16nj..+7, then of +8..+15
                const int r = 16 * kk + lane % 8 + 8 * (lane / 8 % 2), c = (warp_col + 16 * nj) / 8 + lane / 16;
                uint32_t q[4];
                ldmatrix_x4_trans(q, b_tile + c / 8 * TC_PANEL_BYTES + swizzled(r, c % 8));
                b[set][2 * nj][0] = q[0];
                b[set][2 * nj][1] = q[1];
                b[set][2 * nj + 1][0] = q[2];
                b[set][2 * nj + 1][1] = q[3];
            }
        };
        load_fragments(0, 0);
#pragma unroll
        for (int kk = 0; kk < TC_BK / 16; ++kk) {
            if (kk + 1 < TC_BK / 16) load_fragments((kk + 1) % 2, kk + 1);
#pragma unroll
            for (int mi = 0; mi < 4; ++mi)
#pragma unroll
                for (int ni = 0; ni < 8; ++ni)
                    mma_bf16_16816(acc[mi][ni], a[kk % 2][mi], b[kk % 2][ni][0], b[kk % 2][ni][1]);
        }
    }
    if (!TMA) cp_async_wait<0>();

    // Accumulator fragment: lane l holds rows l / 4 and l / 4 + 8, columns 2 (l % 4) and +1.
#pragma unroll
    for (int ni = 0; ni < 8; ++ni) {
        const int col = col0 + warp_col + 8 * ni + 2 * (lane % 4);
        if (col >= N) continue;  // N % 8 == 0, so col + 1 < N too
        const float bias0 = bias != nullptr ? __bfloat162float(bias[col]) : 0.0f;
        const float bias1 = bias != nullptr ? __bfloat162float(bias[col + 1]) : 0.0f;
#pragma unroll
        for (int mi = 0; mi < 4; ++mi)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = row0 + warp_row + 16 * mi + lane / 4 + 8 * h;
                if (row < M)
                    *reinterpret_cast<__nv_bfloat162*>(C + static_cast<size_t>(row) * N + col) =
                        __floats2bfloat162_rn(acc[mi][ni][2 * h] + bias0, acc[mi][ni][2 * h + 1] + bias1);
            }
    }
}

// ---- Going faster on Hopper (sm_90) ----
// Fed by cp.async, step 4 reaches about 0.4x cuBLAS, and all 256 of its threads compute the
// address of every 16-byte chunk they copy. Hopper adds two things:
// (a) TMA, the Tensor Memory Accelerator, feeding the same kernel (template argument TMA, which
//     launch_matmul_tensor_core picks on sm_90): one thread asks it for whole 2-D boxes,
//     described by "tensor maps" built on the host (make_tensor_map, with the launchers); they
//     land already swizzled and count their bytes on an mbarrier, which everyone waits on. The
//     other 255 threads issue no copies and compute no addresses. It reaches 0.55x cuBLAS.
// (b) wgmma, step 5: a warpgroup issues 64x256x16 products that the tensor cores read straight
//     from shared memory, asynchronously, with no ldmatrix and no register fragments. Fed by TMA
//     it reaches 0.88x cuBLAS.

// Step 5 (Hopper only, sm_90a), wgmma: a warpgroup (4 warps, 128 threads) issues one
// asynchronous 64x256x16 product straight from shared memory, 524288 FLOPs per instruction,
// no ldmatrix: the tensor cores read the operands themselves through 64-bit "matrix
// descriptors" (address, strides, swizzle mode). Both operands must be K-major in shared memory,
// so this kernel takes B transposed, as W (N, K) row-major (the layout of nn.Linear's weight)
// and computes C = A @ W^T. A block is 2 warpgroups, each a 64x256 slice of a 128x256 tile of C
// (128 fp32 accumulators per thread). Tiles arrive by TMA as in (a), in the layout the tensor
// cores read: rows of 64 bf16 (128 bytes), 16-byte chunk c of row r at c ^ (r % 8), 8-row groups
// 1024 bytes apart, each stage 1024-byte aligned. The ring has 4 stages but prefetches only 2
// ahead, so one k-tile's wgmmas can still be running when the next k-tile's are issued: the
// stage refilled was read by wgmmas two k-tiles back, already complete. (Fed by cp.async instead,
// as in step 4, this kernel reached 0.64x cuBLAS; with TMA 0.88x.) Needs K % 8 == 0,
// N % 8 == 0 and 16-byte-aligned A and W.
constexpr int WG_BM = 128, WG_BN = 256, WG_BK = 64;  // block tile of C, and the k-step (one 128-byte row)
constexpr int WG_STAGES = 4, WG_AHEAD = WG_STAGES - 2;  // ring depth; k-tiles loaded ahead
constexpr int WG_THREADS = 256;  // 2 warpgroups
constexpr int WG_A_BYTES = WG_BM * WG_BK * 2, WG_STAGE_BYTES = (WG_BM + WG_BN) * WG_BK * 2;
constexpr int WG_SMEM_BYTES = WG_STAGES * WG_STAGE_BYTES + 1024;  // + room to align the ring to 1024 bytes

// Descriptor of a K-major tile in the 128-byte swizzled layout starting at smem_addr: start
// address, leading offset (unused for this layout, 1 by convention), stride offset 1024 bytes
// between 8-row groups, swizzle mode 1 (128 bytes). Fields are in 16-byte units.
__device__ __forceinline__ uint64_t wgmma_desc(uint32_t smem_addr) {
    return static_cast<uint64_t>((smem_addr & 0x3FFFF) >> 4) | static_cast<uint64_t>(1) << 16 |
           static_cast<uint64_t>(1024 >> 4) << 32 | static_cast<uint64_t>(1) << 62;
}

// d (64x256 fp32 per warpgroup) += A (64x16 bf16) * B (16x256 bf16), both from shared memory.
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t desc_a, uint64_t desc_b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile(
        "{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
        "}, %128, %129, accumulate, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
          "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
          "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
          "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
          "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
          "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
          "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]),
          "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]),
          "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]),
          "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]),
          "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]),
          "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]),
          "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]),
          "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]),
          "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]),
          "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]),
          "+f"(d[126]), "+f"(d[127])
        : "l"(desc_a), "l"(desc_b), "r"(1));  // accumulate: d = a b + d (0 would drop d)
#endif
}

__device__ __forceinline__ void wgmma_fence() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void wgmma_commit() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}

// Wait until at most `pending` of this warpgroup's committed wgmma groups are still running.
template <int pending>
__device__ __forceinline__ void wgmma_wait() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(pending) : "memory");
#endif
}

// The accumulators change behind the compiler's back until the wait: pin every access to them
// on both sides of the asynchronous region, so none is moved across it.
__device__ __forceinline__ void fence_registers(float (&d)[128]) {
#pragma unroll
    for (int i = 0; i < 128; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// C = A @ W^T (+ bias): A (M, K), W (N, K), C (M, N), bf16, read through the tensor maps of A
// (boxes of 128 rows) and W (boxes of 256 rows); bias (N values) may be null.
__global__ void __launch_bounds__(WG_THREADS, 1)
    matmul_wgmma_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_w,
                        const __nv_bfloat16* bias, __nv_bfloat16* C, int M, int N, int K) {
    extern __shared__ float4 dynamic_smem[];
    __shared__ alignas(8) uint64_t landed[WG_STAGES];
    const uint32_t smem = (static_cast<uint32_t>(__cvta_generic_to_shared(dynamic_smem)) + 1023) & ~1023u;
    const uint32_t bar0 = static_cast<uint32_t>(__cvta_generic_to_shared(landed));

    const int2 tile = grouped_tile(blockIdx.x, M, N, WG_BM, WG_BN);
    const int row0 = tile.x, col0 = tile.y;
    const int tid = threadIdx.x, warpgroup = tid / 128;
    mbarrier_init(bar0, WG_STAGES);

    // Stage s: the A tile (128 rows), then the W tile (256 rows), rows of 8 chunks of 16 bytes.
    auto load_stage = [&](int stage, int k0) {  // thread 0 only
        const uint32_t tile = smem + stage * WG_STAGE_BYTES, bar = bar0 + 8 * stage;
        mbarrier_expect_bytes(bar, WG_STAGE_BYTES);
        tma_load_box(tile, &map_a, k0, row0, bar);
        tma_load_box(tile + WG_A_BYTES, &map_w, k0, col0, bar);
    };

    float d[128] = {};
    const int k_tiles = static_cast<int>(ceil_div(K, WG_BK));
    if (tid == 0)
        for (int s = 0; s < WG_AHEAD && s < k_tiles; ++s) load_stage(s, s * WG_BK);
    for (int t = 0; t < k_tiles; ++t) {
        mbarrier_wait(bar0 + 8 * (t % WG_STAGES), t / WG_STAGES % 2);  // tile t has landed
        __syncthreads();  // and the wgmmas of tile t - 2 have completed, in both warpgroups
        const int next = t + WG_AHEAD;
        if (tid == 0 && next < k_tiles) load_stage(next % WG_STAGES, next * WG_BK);  // refills tile t - 2's stage

        const uint32_t a_tile = smem + (t % WG_STAGES) * WG_STAGE_BYTES + warpgroup * 64 * 128;
        const uint32_t w_tile = smem + (t % WG_STAGES) * WG_STAGE_BYTES + WG_A_BYTES;
        fence_registers(d);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < WG_BK / 16; ++kk)  // the next 16 k are 32 bytes further along each row
            wgmma_m64n256k16(d, wgmma_desc(a_tile + 32 * kk), wgmma_desc(w_tile + 32 * kk));
        wgmma_commit();
        wgmma_wait<1>();  // tile t's wgmmas may run on; tile t - 1's are done
        fence_registers(d);
    }
    wgmma_wait<0>();
    fence_registers(d);

    // Accumulator layout: warp w of the warpgroup holds rows 16w..16w+15 of its 64-row slice;
    // d[4j + q] is row lane / 4 (+ 8 for q >= 2), column 8j + 2 (lane % 4) (+ 1 for odd q).
    const int lane = tid % 32, row_base = row0 + warpgroup * 64 + (tid % 128) / 32 * 16 + lane / 4;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
        const int col = col0 + 8 * j + 2 * (lane % 4);
        if (col >= N) continue;
        const float bias0 = bias != nullptr ? __bfloat162float(bias[col]) : 0.0f;
        const float bias1 = bias != nullptr ? __bfloat162float(bias[col + 1]) : 0.0f;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = row_base + 8 * h;
            if (row < M)
                *reinterpret_cast<__nv_bfloat162*>(C + static_cast<size_t>(row) * N + col) =
                    __floats2bfloat162_rn(d[4 * j + 2 * h] + bias0, d[4 * j + 2 * h + 1] + bias1);
        }
    }
}

// The launchers: C = A @ B (+ bias), everything row-major and contiguous.
cudaError_t launch_matmul_naive(const float* A, const float* B, float* C, int M, int N, int K, cudaStream_t stream) {
    if (M == 0 || N == 0) return cudaSuccess;
    const dim3 block(32, 8), grid(ceil_div(N, 32), ceil_div(M, 8));
    matmul_naive_kernel<<<grid, block, 0, stream>>>(A, B, C, M, N, K);
    return cudaGetLastError();
}

cudaError_t launch_matmul_tiled(const float* A, const float* B, float* C, int M, int N, int K, cudaStream_t stream) {
    if (M == 0 || N == 0) return cudaSuccess;
    const dim3 block(TILE, TILE), grid(ceil_div(N, TILE), ceil_div(M, TILE));
    matmul_tiled_kernel<<<grid, block, 0, stream>>>(A, B, C, M, N, K);
    return cudaGetLastError();
}

cudaError_t launch_matmul_register_tiled(const float* A, const float* B, const float* bias, float* C, int M, int N,
                                         int K, cudaStream_t stream) {
    if (M == 0 || N == 0) return cudaSuccess;
    const dim3 grid(ceil_div(N, RT_BN), ceil_div(M, RT_BM));
    if (K % 4 == 0 && N % 4 == 0 && aligned16(A) && aligned16(B) && aligned16(C))
        matmul_register_tiled_kernel<true><<<grid, RT_THREADS, 0, stream>>>(A, B, bias, C, M, N, K);
    else
        matmul_register_tiled_kernel<false><<<grid, RT_THREADS, 0, stream>>>(A, B, bias, C, M, N, K);
    return cudaGetLastError();
}

// A tensor map describes a row-major (rows, cols) bf16 matrix to TMA: its address, sizes and
// row stride, the box one copy fetches (box_rows x 64 columns: 128 bytes a row, the width of the
// swizzle) and the 128-byte swizzle. The encoder lives in the driver (libcuda); the runtime looks
// it up by name, so nothing more is linked. False if the driver has none or refuses the matrix.
static bool make_tensor_map(CUtensorMap* map, const void* ptr, int rows, int cols, int box_rows) {
    static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
        void* fn = nullptr;
        cudaDriverEntryPointQueryResult found{};
#if CUDART_VERSION >= 12050
        const cudaError_t err =
            cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found);
#else
        const cudaError_t err = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &found);
#endif
        const bool ok = err == cudaSuccess && found == cudaDriverEntryPointSuccess;
        return ok ? reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn) : nullptr;
    }();
    if (encode == nullptr) return false;
    const cuuint64_t sizes[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};  // innermost first
    const cuuint64_t row_stride[1] = {static_cast<cuuint64_t>(cols) * 2};                           // bytes
    const cuuint32_t box[2] = {64, static_cast<cuuint32_t>(box_rows)}, element_strides[2] = {1, 1};
    return encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(ptr), sizes, row_stride, box,
                  element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                  CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

static cudaError_t compute_capability_major(int* major) {
    int device = 0;
    const cudaError_t err = cudaGetDevice(&device);
    return err != cudaSuccess ? err : cudaDeviceGetAttribute(major, cudaDevAttrComputeCapabilityMajor, device);
}

// loads: 0 cp.async, 1 TMA (sm_90 and a driver with the tensor-map encoder, else
// cudaErrorNotSupported), -1 TMA where the GPU has it, else cp.async.
cudaError_t launch_matmul_tensor_core(const __nv_bfloat16* A, const __nv_bfloat16* B, const __nv_bfloat16* bias,
                                      __nv_bfloat16* C, int M, int N, int K, int loads, cudaStream_t stream) {
    if (M == 0 || N == 0) return cudaSuccess;
    int major = 0;
    cudaError_t err = compute_capability_major(&major);
    if (err != cudaSuccess) return err;
    // A in boxes of 128 rows x 64 k, B in boxes of 64 k x 64 columns; K == 0 loads nothing (C = bias)
    // and has no matrix to describe
    CUtensorMap map_a{}, map_b{};
    const bool tma = loads != 0 && major >= 9 &&
                     (K == 0 || (make_tensor_map(&map_a, A, M, K, TC_BM) && make_tensor_map(&map_b, B, K, N, TC_BK)));
    if (loads == 1 && !tma) return cudaErrorNotSupported;
    const auto kernel = tma ? matmul_tensor_core_kernel<true> : matmul_tensor_core_kernel<false>;
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, TC_SMEM_BYTES);
    if (err != cudaSuccess) return err;
    const size_t blocks = ceil_div(M, TC_BM) * ceil_div(N, TC_BN);
    kernel<<<blocks, TC_THREADS, TC_SMEM_BYTES, stream>>>(map_a, map_b, A, B, bias, C, M, N, K);
    return cudaGetLastError();
}

// C = A @ W^T (+ bias). Hopper only: the kernel is empty unless built for sm_90a.
cudaError_t launch_matmul_wgmma(const __nv_bfloat16* A, const __nv_bfloat16* W, const __nv_bfloat16* bias,
                                __nv_bfloat16* C, int M, int N, int K, cudaStream_t stream) {
    if (M == 0 || N == 0) return cudaSuccess;
    int major = 0;
    cudaError_t err = compute_capability_major(&major);
    if (err != cudaSuccess) return err;
    CUtensorMap map_a{}, map_w{};  // A in boxes of 128 rows x 64 k, W in boxes of 256 rows x 64 k
    const bool maps = K == 0 || (make_tensor_map(&map_a, A, M, K, WG_BM) && make_tensor_map(&map_w, W, N, K, WG_BN));
    if (major != 9 || !maps) return cudaErrorNotSupported;
    err = cudaFuncSetAttribute(matmul_wgmma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, WG_SMEM_BYTES);
    if (err != cudaSuccess) return err;
    const size_t blocks = ceil_div(M, WG_BM) * ceil_div(N, WG_BN);
    matmul_wgmma_kernel<<<blocks, WG_THREADS, WG_SMEM_BYTES, stream>>>(map_a, map_w, bias, C, M, N, K);
    return cudaGetLastError();
}
// ---- END KERNELS ----

enum Variant { NAIVE, TILED, REGISTER_TILED, TENSOR_CORE, TENSOR_CORE_TMA, WGMMA };
static const char* const VARIANT_NAMES[] = {"naive", "tiled", "register_tiled", "tensor_core", "tensor_core_tma",
                                            "wgmma"};

// Inputs exactly as the kernel sees them (rounded to bf16 for the tensor-core kernels), as floats.
struct Problem {
    int M, N, K;
    std::vector<float> a, b, bias;  // bias empty: none
};

static Problem make_problem(int M, int N, int K, bool with_bias, bool bf16) {
    Problem p{M, N, K, random_vector(static_cast<size_t>(M) * K, M * 31 + K),
              random_vector(static_cast<size_t>(K) * N, N * 17 + K), {}};
    if (with_bias) p.bias = random_vector(N, N + 5);
    if (bf16)
        for (auto* v : {&p.a, &p.b, &p.bias})
            for (auto& x : *v) x = __bfloat162float(__float2bfloat16(x));
    return p;
}

static double ref_element(const Problem& p, int row, int col) {
    double acc = p.bias.empty() ? 0.0 : p.bias[col];
    for (int k = 0; k < p.K; ++k)
        acc += static_cast<double>(p.a[static_cast<size_t>(row) * p.K + k]) * p.b[static_cast<size_t>(k) * p.N + col];
    return acc;
}

static std::vector<__nv_bfloat16> to_bf16(const std::vector<float>& x) {
    std::vector<__nv_bfloat16> y(x.size());
    for (size_t i = 0; i < x.size(); ++i) y[i] = __float2bfloat16(x[i]);
    return y;
}

// (rows, cols) row-major -> (cols, rows) row-major: the wgmma kernel takes B as W = B^T.
static std::vector<float> transpose(const std::vector<float>& x, int rows, int cols) {
    std::vector<float> y(x.size());
    for (int r = 0; r < rows; ++r)
        for (int c = 0; c < cols; ++c) y[static_cast<size_t>(c) * rows + r] = x[static_cast<size_t>(r) * cols + c];
    return y;
}

static bool is_tensor_core(int variant) { return variant >= TENSOR_CORE; }

// Runs one variant on a poisoned output and returns C; with reps > 0 also its median time.
static std::vector<float> run(int variant, const Problem& p, int reps, float* ms) {
    const size_t mn = static_cast<size_t>(p.M) * p.N;
    std::vector<float> c(mn);
    if (is_tensor_core(variant)) {
        DeviceBuffer<__nv_bfloat16> a(to_bf16(p.a)), bias(to_bf16(p.bias)), out(mn);
        DeviceBuffer<__nv_bfloat16> b(to_bf16(variant == WGMMA ? transpose(p.b, p.K, p.N) : p.b));
        const __nv_bfloat16* bias_ptr = p.bias.empty() ? nullptr : bias.ptr;
        auto launch = [&] {
            if (variant == WGMMA) return launch_matmul_wgmma(a.ptr, b.ptr, bias_ptr, out.ptr, p.M, p.N, p.K, nullptr);
            const int loads = variant == TENSOR_CORE_TMA ? 1 : 0;  // TMA, or cp.async
            return launch_matmul_tensor_core(a.ptr, b.ptr, bias_ptr, out.ptr, p.M, p.N, p.K, loads, nullptr);
        };
        out.poison();
        CUDA_CHECK(launch());
        const auto host = out.download();
        for (size_t i = 0; i < mn; ++i) c[i] = __bfloat162float(host[i]);
        if (reps > 0) *ms = time_ms(launch, reps);
    } else {
        DeviceBuffer<float> a(p.a), b(p.b), bias(p.bias), out(mn);
        const float* bias_ptr = p.bias.empty() ? nullptr : bias.ptr;
        auto launch = [&] {
            if (variant == NAIVE) return launch_matmul_naive(a.ptr, b.ptr, out.ptr, p.M, p.N, p.K, nullptr);
            if (variant == TILED) return launch_matmul_tiled(a.ptr, b.ptr, out.ptr, p.M, p.N, p.K, nullptr);
            return launch_matmul_register_tiled(a.ptr, b.ptr, bias_ptr, out.ptr, p.M, p.N, p.K, nullptr);
        };
        out.poison();
        CUDA_CHECK(launch());
        c = out.download();
        if (reps > 0) *ms = time_ms(launch, reps);
    }
    return c;
}

// fp32 dot products of length K err by ~eps sqrt(K); bf16 output rounding is ~2e-3.
static double tolerance(int variant) { return is_tensor_core(variant) ? 5e-3 : 2e-5; }

static bool check(int variant, int M, int N, int K, bool with_bias) {
    const Problem p = make_problem(M, N, K, with_bias, is_tensor_core(variant));
    const auto c = run(variant, p, 0, nullptr);
    std::vector<double> ref(c.size());
    for (int row = 0; row < M; ++row)
        for (int col = 0; col < N; ++col) ref[static_cast<size_t>(row) * N + col] = ref_element(p, row, col);
    char what[80];
    std::snprintf(what, sizeof what, "%s %dx%dx%d%s", VARIANT_NAMES[variant], M, N, K, with_bias ? " +bias" : "");
    return report(what, rel_error(c, ref), tolerance(variant));
}

// Times one variant at size^3 and checks 64 sampled elements of the result against float64.
static bool bench(int variant, int size, int reps) {
    const Problem p = make_problem(size, size, size, false, is_tensor_core(variant));
    float ms = 0.0f;
    const auto c = run(variant, p, reps, &ms);
    std::printf("  %-16s %d^3: %8.3f ms, %6.1f TFLOP/s\n", VARIANT_NAMES[variant], size, ms,
                2.0 * size * size * size / ms / 1e9);
    std::vector<float> got;
    std::vector<double> ref;
    for (uint64_t i = 0, s = 12345; i < 64; ++i) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        const int row = static_cast<int>((s >> 33) % size), col = static_cast<int>((s >> 13) % size);
        got.push_back(c[static_cast<size_t>(row) * size + col]);
        ref.push_back(ref_element(p, row, col));
    }
    char what[80];
    std::snprintf(what, sizeof what, "%s %d^3, 64 sampled elements", VARIANT_NAMES[variant], size);
    return report(what, rel_error(got, ref), tolerance(variant));
}

int main(int argc, char** argv) {
    print_device("matmul");
    bool ok = true;
    // awkward shapes: 1, primes, non-multiples of every tile; K % 4 == N % 4 == 0 takes the float4 path
    const int fp32_shapes[][3] = {{1, 1, 1},       {17, 33, 1023},   {1023, 17, 4097},
                                  {129, 4097, 17}, {300, 516, 1024}, {4097, 4, 8}};
    for (const auto& s : fp32_shapes)
        for (int variant : {NAIVE, TILED, REGISTER_TILED}) ok &= check(variant, s[0], s[1], s[2], false);
    ok &= check(REGISTER_TILED, 300, 516, 1024, true);
    ok &= check(REGISTER_TILED, 17, 33, 1023, true);
    // the tensor-core kernels need K % 8 == 0 and N % 8 == 0; M is free. TMA and wgmma need sm_90.
    int device = 0, major = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    std::vector<int> tensor_core_variants = {TENSOR_CORE};
    if (major == 9) tensor_core_variants.insert(tensor_core_variants.end(), {TENSOR_CORE_TMA, WGMMA});
    else std::printf("  (TMA and wgmma skipped: they need an sm_90 GPU)\n");
    const int tc_shapes[][3] = {{1, 8, 8},        {17, 1032, 4096}, {1023, 264, 72},
                                {300, 520, 1000}, {4097, 8, 24},    {129, 256, 0}};
    for (int variant : tensor_core_variants) {
        for (const auto& s : tc_shapes) ok &= check(variant, s[0], s[1], s[2], false);
        ok &= check(variant, 300, 520, 1000, true);
    }
    if (!check_only(argc, argv)) {
        const int size = 4096;
        ok &= bench(NAIVE, size, 3);
        ok &= bench(TILED, size, 5);
        ok &= bench(REGISTER_TILED, size, 20);
        for (int variant : tensor_core_variants) ok &= bench(variant, size, 20);
    }
    std::printf("%s\n", ok ? "PASS" : "FAIL");
    return ok ? 0 : 1;
}
