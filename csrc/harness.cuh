// Host-side plumbing for the csrc/ test programs: error checks, reproducible random inputs,
// device buffers, error measures and CUDA-event timing. Not part of the stage-04 strings.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

// Every CUDA call is checked: a failed call prints where and why, and the program exits 1.
#define CUDA_CHECK(call)                                                                  \
    do {                                                                                  \
        const cudaError_t err_ = (call);                                                  \
        if (err_ != cudaSuccess) {                                                        \
            std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call,            \
                         cudaGetErrorString(err_));                                       \
            std::exit(1);                                                                 \
        }                                                                                 \
    } while (0)

// Uniform floats in [lo, hi) from a 64-bit linear congruential generator: the same inputs on
// every run and every machine.
inline std::vector<float> random_vector(size_t n, uint64_t seed, float lo = -1.0f, float hi = 1.0f) {
    std::vector<float> v(n);
    uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
    for (auto& x : v) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        x = lo + (hi - lo) * static_cast<float>(s >> 40) / static_cast<float>(1ull << 24);
    }
    return v;
}

template <class T>
struct DeviceBuffer {
    T* ptr = nullptr;
    size_t n = 0;
    explicit DeviceBuffer(size_t count) : n(count) { CUDA_CHECK(cudaMalloc(&ptr, std::max<size_t>(n, 1) * sizeof(T))); }
    explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
    ~DeviceBuffer() { cudaFree(ptr); }
    DeviceBuffer(const DeviceBuffer&) = delete;
    DeviceBuffer& operator=(const DeviceBuffer&) = delete;
    void upload(const std::vector<T>& host) {
        if (n > 0) CUDA_CHECK(cudaMemcpy(ptr, host.data(), n * sizeof(T), cudaMemcpyHostToDevice));
    }
    std::vector<T> download() const {
        std::vector<T> host(n);
        if (n > 0) CUDA_CHECK(cudaMemcpy(host.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
        return host;
    }
    // All bits set is a NaN in float and in bf16: an output element the kernel never writes fails.
    void poison() { CUDA_CHECK(cudaMemset(ptr, 0xFF, n * sizeof(T))); }
};

// ||got - ref|| / ||ref||; any NaN in got makes it infinite.
template <class T, class ToDouble>
double rel_error(const std::vector<T>& got, const std::vector<double>& ref, ToDouble to_double) {
    double diff = 0.0, norm = 0.0;
    for (size_t i = 0; i < ref.size(); ++i) {
        const double g = to_double(got[i]);
        if (std::isnan(g)) return INFINITY;
        diff += (g - ref[i]) * (g - ref[i]);
        norm += ref[i] * ref[i];
    }
    return std::sqrt(diff / std::max(norm, 1e-300));
}

inline double rel_error(const std::vector<float>& got, const std::vector<double>& ref) {
    return rel_error(got, ref, [](float x) { return static_cast<double>(x); });
}

// Prints one result line and returns whether it passed.
inline bool report(const char* what, double err, double tol) {
    const bool ok = err <= tol;
    std::printf("  %-44s rel err %.2e (tol %.0e)  %s\n", what, err, tol, ok ? "ok" : "FAIL");
    return ok;
}

// Median time in ms of `reps` runs of launch(), after one warm-up run, with CUDA events.
template <class F>
float time_ms(F launch, int reps = 20) {
    cudaEvent_t start, stop;
    CUDA_CHECK(cudaEventCreate(&start));
    CUDA_CHECK(cudaEventCreate(&stop));
    CUDA_CHECK(launch());
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<float> times(reps);
    for (auto& t : times) {
        CUDA_CHECK(cudaEventRecord(start));
        CUDA_CHECK(launch());
        CUDA_CHECK(cudaEventRecord(stop));
        CUDA_CHECK(cudaEventSynchronize(stop));
        CUDA_CHECK(cudaEventElapsedTime(&t, start, stop));
    }
    CUDA_CHECK(cudaEventDestroy(start));
    CUDA_CHECK(cudaEventDestroy(stop));
    std::sort(times.begin(), times.end());
    return times[reps / 2];
}

// `--check` runs only the correctness checks at small sizes: what `make sanitize` uses, since
// compute-sanitizer slows every access down by orders of magnitude.
inline bool check_only(int argc, char** argv) { return argc > 1 && std::strcmp(argv[1], "--check") == 0; }

// Exit status of a program that finds no GPU to run on, apart from 1 (a check failed), so that
// `make run` can say it once and stop instead of repeating it for every program.
constexpr int EXIT_NO_GPU = 2;

// Without a GPU the runtime's first call fails: with cudaErrorNoDevice, or, where no NVIDIA driver
// is installed at all, with cudaErrorInsufficientDriver, whose text ("CUDA driver version is
// insufficient for CUDA runtime version") reads like a version problem. Say what it means, stop.
inline void require_gpu(const char* program) {
    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    if (err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver || (err == cudaSuccess && count == 0)) {
        int runtime = 0;
        cudaRuntimeGetVersion(&runtime);  // e.g. 13000 for CUDA 13.0
        std::fprintf(stderr,
                     "%s: no CUDA GPU found (cudaGetDeviceCount: %s); these programs need an NVIDIA GPU "
                     "with a driver for CUDA %d.%d or newer\n",
                     program, err == cudaSuccess ? "0 devices" : cudaGetErrorString(err), runtime / 1000,
                     runtime % 1000 / 10);
        std::exit(EXIT_NO_GPU);
    }
    CUDA_CHECK(err);
}

// The first call of every program's main(): stops with EXIT_NO_GPU where there is no GPU.
inline void print_device(const char* program) {
    require_gpu(program);
    int device = 0;
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDevice(&device));
    CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
    std::printf("%s on %s (sm_%d%d, %d SMs)\n", program, prop.name, prop.major, prop.minor, prop.multiProcessorCount);
}
