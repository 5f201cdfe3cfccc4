#include "reference/dense.h"

#include <cstring>

namespace sparseattn::reference {

namespace {

float half_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  std::uint32_t exponent = (h >> 10) & 0x1fu;
  std::uint32_t mantissa = h & 0x3ffu;
  std::uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);  // inf / nan
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exponent = 113;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --exponent;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Round-to-nearest-even float -> IEEE half.
std::uint16_t float_to_half(float f) {
  std::uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const std::uint16_t sign = static_cast<std::uint16_t>((bits >> 16) & 0x8000u);
  const std::uint32_t abs = bits & 0x7fffffffu;
  if (abs >= 0x7f800000u) return sign | (abs > 0x7f800000u ? 0x7e00u : 0x7c00u);
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: overflow to inf
  if (abs < 0x38800000u) {                        // below the smallest normal half: subnormal or zero
    if (abs < 0x33000000u) return sign;           // < 2^-25 rounds to zero
    const std::uint32_t exponent = abs >> 23;
    const std::uint32_t mantissa = (abs & 0x7fffffu) | 0x800000u;
    const std::uint32_t shift = 126 - exponent;   // 14 + (113 - exponent) ... into 10-bit subnormal
    std::uint32_t value = mantissa >> shift;
    const std::uint32_t rest = mantissa & ((1u << shift) - 1);
    const std::uint32_t half_way = 1u << (shift - 1);
    if (rest > half_way || (rest == half_way && (value & 1u))) ++value;
    return sign | static_cast<std::uint16_t>(value);
  }
  std::uint32_t value = ((abs >> 13) - (112u << 10));
  const std::uint32_t rest = abs & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (value & 1u))) ++value;
  return sign | static_cast<std::uint16_t>(value);
}

float bfloat16_to_float(std::uint16_t h) {
  const std::uint32_t bits = static_cast<std::uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

std::uint16_t float_to_bfloat16(float f) {
  std::uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((bits >> 16) | 0x40u);  // quiet nan
  bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even
  return static_cast<std::uint16_t>(bits >> 16);
}

double read_element(const TensorView& t, std::int64_t offset) {
  const char* base = static_cast<const char*>(t.data);
  switch (t.dtype) {
    case DType::float16: return half_to_float(reinterpret_cast<const std::uint16_t*>(base)[offset]);
    case DType::bfloat16: return bfloat16_to_float(reinterpret_cast<const std::uint16_t*>(base)[offset]);
    case DType::float32: return reinterpret_cast<const float*>(base)[offset];
    case DType::float64: return reinterpret_cast<const double*>(base)[offset];
    case DType::int32: return reinterpret_cast<const std::int32_t*>(base)[offset];
    case DType::boolean: return reinterpret_cast<const std::uint8_t*>(base)[offset] != 0;
    case DType::uint8: return reinterpret_cast<const std::uint8_t*>(base)[offset];
    case DType::int64: return static_cast<double>(reinterpret_cast<const std::int64_t*>(base)[offset]);
  }
  return 0;
}

void write_element(const TensorView& t, std::int64_t offset, double value) {
  char* base = static_cast<char*>(t.data);
  switch (t.dtype) {
    case DType::float16:
      reinterpret_cast<std::uint16_t*>(base)[offset] = float_to_half(static_cast<float>(value));
      break;
    case DType::bfloat16:
      reinterpret_cast<std::uint16_t*>(base)[offset] = float_to_bfloat16(static_cast<float>(value));
      break;
    case DType::float32: reinterpret_cast<float*>(base)[offset] = static_cast<float>(value); break;
    case DType::float64: reinterpret_cast<double*>(base)[offset] = value; break;
    case DType::int32: reinterpret_cast<std::int32_t*>(base)[offset] = static_cast<std::int32_t>(value); break;
    case DType::boolean: reinterpret_cast<std::uint8_t*>(base)[offset] = value != 0; break;
    case DType::uint8: reinterpret_cast<std::uint8_t*>(base)[offset] = static_cast<std::uint8_t>(value); break;
    case DType::int64: reinterpret_cast<std::int64_t*>(base)[offset] = static_cast<std::int64_t>(value); break;
  }
}

// Calls visit(flat_row_major_index, strided_offset) for every element of t.
template <class Visit>
void for_each_element(const TensorView& t, Visit&& visit) {
  std::array<std::int64_t, kMaxRank> shape{1, 1, 1, 1};
  std::array<std::int64_t, kMaxRank> stride{0, 0, 0, 0};
  const int pad = kMaxRank - t.rank;
  for (int i = 0; i < t.rank; ++i) {
    shape[pad + i] = t.shape[i];
    stride[pad + i] = t.stride[i];
  }
  std::int64_t flat = 0;
  for (std::int64_t a = 0; a < shape[0]; ++a)
    for (std::int64_t b = 0; b < shape[1]; ++b)
      for (std::int64_t c = 0; c < shape[2]; ++c)
        for (std::int64_t d = 0; d < shape[3]; ++d)
          visit(flat++, a * stride[0] + b * stride[1] + c * stride[2] + d * stride[3]);
}

}  // namespace

Dense Dense::zeros(std::vector<std::int64_t> shape) {
  Dense dense;
  std::int64_t n = 1;
  for (std::int64_t extent : shape) n *= extent;
  dense.shape = std::move(shape);
  dense.values.assign(static_cast<std::size_t>(n), 0.0);
  return dense;
}

Dense load(const TensorView& t) {
  Dense dense = Dense::zeros(std::vector<std::int64_t>(t.shape.begin(), t.shape.begin() + t.rank));
  for_each_element(t, [&](std::int64_t flat, std::int64_t offset) { dense.values[flat] = read_element(t, offset); });
  return dense;
}

void store(const Dense& values, const TensorView& t) {
  for_each_element(t, [&](std::int64_t flat, std::int64_t offset) { write_element(t, offset, values.values[flat]); });
}

Dense with_batch_dim(Dense dense, bool packed) {
  if (packed) dense.shape.insert(dense.shape.begin(), 1);
  return dense;
}

std::vector<std::int32_t> load_int32(const TensorView& t) {
  std::vector<std::int32_t> values(static_cast<std::size_t>(t.numel()));
  const auto* data = static_cast<const std::int32_t*>(t.data);
  for_each_element(t, [&](std::int64_t flat, std::int64_t offset) { values[flat] = data[offset]; });
  return values;
}

void store_int32(const std::vector<std::int32_t>& values, const TensorView& t) {
  auto* data = static_cast<std::int32_t*>(t.data);
  for_each_element(t, [&](std::int64_t flat, std::int64_t offset) { data[offset] = values[flat]; });
}

std::vector<std::uint8_t> load_bool(const TensorView& t) {
  std::vector<std::uint8_t> values(static_cast<std::size_t>(t.numel()));
  const auto* data = static_cast<const std::uint8_t*>(t.data);
  for_each_element(t, [&](std::int64_t flat, std::int64_t offset) { values[flat] = data[offset] != 0; });
  return values;
}

std::vector<Span> spans(const detail::TokenLayout& layout, const TensorView& cu_seqlens) {
  std::vector<Span> result(static_cast<std::size_t>(layout.batch));
  if (!layout.packed) {
    for (std::int64_t b = 0; b < layout.batch; ++b) result[b] = {b, 0, layout.rows};
    return result;
  }
  const std::vector<std::int32_t> cu = load_int32(cu_seqlens);
  for (std::int64_t b = 0; b < layout.batch; ++b) result[b] = {0, cu[b], std::int64_t{cu[b + 1]} - cu[b]};
  return result;
}

}  // namespace sparseattn::reference
