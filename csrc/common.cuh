// Device helpers shared by the stage-04 kernel families: warp and block reductions, and the
// row-access pattern of the row-wise kernels (reductions, softmax, layer norm).
// The text between the BEGIN and END lines is the string COMMON_CU in 04_cuda_kernels.py, where
// it opens the one load_inline module; tests/test_04_cuda_kernels.py fails if the two drift.
#pragma once
// ---- BEGIN KERNELS ----
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cstddef>
#include <cstdint>

inline __host__ __device__ size_t ceil_div(size_t a, size_t b) { return (a + b - 1) / b; }

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// An "Op" is a struct with static identity() and combine(a, b). The reductions below regroup
// combine() freely, so it must be associative (floating-point addition is, up to rounding).
__device__ __forceinline__ float shfl_xor(float v, int lane_mask) {
    return __shfl_xor_sync(0xffffffffu, v, lane_mask);
}

// Butterfly over the 32 lanes of a warp: five register exchanges, no shared memory, no barrier,
// and afterwards every lane holds the result.
template <class Op, class T>
__device__ __forceinline__ T warp_allreduce(T v) {
#pragma unroll
    for (int lane_mask = 16; lane_mask > 0; lane_mask /= 2) v = Op::combine(v, shfl_xor(v, lane_mask));
    return v;
}

// Reduction over a block (blockDim.x a multiple of 32): each warp reduces its 32 values with
// shuffles, one value per warp passes through shared memory, and every warp then reduces those
// partials, so all threads return the block's result.
template <class Op, class T>
__device__ T block_allreduce(T v) {
    __shared__ T partial[32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    v = warp_allreduce<Op>(v);
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = lane < static_cast<int>(blockDim.x / 32) ? partial[lane] : Op::identity();
    v = warp_allreduce<Op>(v);
    __syncthreads();  // a second call may overwrite `partial` only after everyone has read it
    return v;
}

// Calls f(i, row[i]) for this thread's share of row[0, n): thread t takes elements t,
// t + blockDim.x, ... (float4 groups when vec), so at every step the warp reads one contiguous
// span and the loads coalesce. vec needs n % 4 == 0 and a 16-byte-aligned row.
template <class F>
__device__ __forceinline__ void row_for_each(const float* row, int n, bool vec, F f) {
    if (vec) {
        const float4* row4 = reinterpret_cast<const float4*>(row);
#pragma unroll 4
        for (int j = threadIdx.x; j < n / 4; j += blockDim.x) {
            const float4 v = row4[j];
            f(4 * j, v.x);
            f(4 * j + 1, v.y);
            f(4 * j + 2, v.z);
            f(4 * j + 3, v.w);
        }
    } else {
#pragma unroll 4
        for (int i = threadIdx.x; i < n; i += blockDim.x) f(i, row[i]);
    }
}

// out[i] = g(i, in[i]) over a row, with the access pattern of row_for_each: the second pass of
// the kernels that stream rows too long for registers.
template <class G>
__device__ __forceinline__ void row_map(const float* in, float* out, int n, bool vec, G g) {
    if (vec) {
        const float4* in4 = reinterpret_cast<const float4*>(in);
        float4* out4 = reinterpret_cast<float4*>(out);
        for (int j = threadIdx.x; j < n / 4; j += blockDim.x) {
            const float4 v = in4[j];
            out4[j] = make_float4(g(4 * j, v.x), g(4 * j + 1, v.y), g(4 * j + 2, v.z), g(4 * j + 3, v.w));
        }
    } else {
        for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = g(i, in[i]);
    }
}

// The softmax and layer-norm kernels hold a whole row in registers between reading it and writing
// the result: thread t of the row's block owns float4 groups t, t + blockDim.x, ... (ROW_CHUNKS
// of them), loaded before any arithmetic, so each thread has ROW_CHUNKS 16-byte loads in flight.
// That depth is what reaches the bandwidth: on the H200 a softmax over 16384 x 4096 floats ran at
// 46%, 75%, 95% and 95% of copy bandwidth with 1, 2, 4 and 8 groups a thread.
constexpr int ROW_CHUNKS = 8;                     // 32 floats a thread
constexpr int ROW_THREADS_MAX = 512;              // at most 128 registers a thread for 512 threads
constexpr int ROW_REG_MAX = 4 * ROW_CHUNKS * ROW_THREADS_MAX;  // 16384: longer rows are streamed

// Threads per block for a row of n <= ROW_REG_MAX floats held in registers: whole warps.
inline int row_block_threads(int n) {
    const int threads = static_cast<int>(ceil_div(ceil_div(n, 4 * ROW_CHUNKS), 32)) * 32;
    return threads < 32 ? 32 : threads;
}

// Group j of a row: elements 4j .. 4j + 3 (pad past n). vec: n % 4 == 0 and a 16-byte-aligned
// row, so a group is one float4 load or store.
__device__ __forceinline__ void load_group(const float* row, int n, bool vec, int j, float* g, float pad) {
    if (vec) {
        const float4 q = 4 * j < n ? reinterpret_cast<const float4*>(row)[j] : make_float4(pad, pad, pad, pad);
        g[0] = q.x;
        g[1] = q.y;
        g[2] = q.z;
        g[3] = q.w;
    } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) g[e] = 4 * j + e < n ? row[4 * j + e] : pad;
    }
}

__device__ __forceinline__ void store_group(float* row, int n, bool vec, int j, const float* g) {
    if (vec) {
        if (4 * j < n) reinterpret_cast<float4*>(row)[j] = make_float4(g[0], g[1], g[2], g[3]);
    } else {
#pragma unroll
        for (int e = 0; e < 4; ++e)
            if (4 * j + e < n) row[4 * j + e] = g[e];
    }
}

// v = this thread's ROW_CHUNKS groups of row[0, n): v[4c .. 4c + 3] is group threadIdx.x + c * blockDim.x.
__device__ __forceinline__ void load_row(const float* row, int n, bool vec, float (&v)[4 * ROW_CHUNKS], float pad) {
#pragma unroll
    for (int c = 0; c < ROW_CHUNKS; ++c) load_group(row, n, vec, threadIdx.x + c * blockDim.x, v + 4 * c, pad);
}
// ---- END KERNELS ----
