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

// out[i] = g(i, in[i]) over a row, with the access pattern of row_for_each (so a thread reads
// back exactly the elements it cached in a first pass: no barrier needed between the passes).
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

// The row kernels keep a row of up to ROW_CACHE_MAX floats (32 KB) in shared memory between their
// two passes: under the 48 KB a block may use without opting in, with room for block_allreduce.
constexpr int ROW_CACHE_MAX = 8192;

// Threads per block for the kernels that give each row of n floats one block: about 16 elements
// per thread, in whole warps, from one warp up to 1024 threads.
inline int row_block_threads(int n) {
    const int threads = (n / 16 + 31) / 32 * 32;
    return threads < 32 ? 32 : (threads > 1024 ? 1024 : threads);
}
// ---- END KERNELS ----
