// Plain-data tensor descriptions shared by every operation of the C++ API.
// No allocation, no ownership: a TensorView names memory that the caller owns.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace sparseattn {

// uint8: block-sparse tile states (flash_attention); int64: counters (flash_attention's work_counter).
enum class DType : std::uint8_t { float16, bfloat16, float32, float64, int32, boolean, uint8, int64 };
enum class DeviceType : std::uint8_t { cpu, cuda };

std::size_t element_size(DType dtype);
const char* dtype_name(DType dtype);
const char* device_name(DeviceType device);

inline constexpr int kMaxRank = 4;

// A strided view of up to four dimensions. `rank == 0` means "absent" (optional arguments); the API has
// no scalar tensors. Strides count elements, not bytes, and are 64-bit so one sequence may exceed 2^31
// elements. `data` may be null only when the view has no elements.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::float32;
  DeviceType device = DeviceType::cpu;
  int device_index = 0;
  int rank = 0;
  std::array<std::int64_t, kMaxRank> shape{};
  std::array<std::int64_t, kMaxRank> stride{};

  bool present() const { return rank > 0; }
  std::int64_t numel() const;
  bool is_contiguous() const;
  std::string shape_string() const;  // "[2, 64, 4, 128]"

  // A row-major (contiguous) view of `data` with the given shape.
  static TensorView contiguous(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                               DeviceType device = DeviceType::cpu, int device_index = 0);
};

// The CUDA stream an operation is enqueued on (a cudaStream_t); ignored by the CPU backend.
using Stream = void*;

}  // namespace sparseattn
