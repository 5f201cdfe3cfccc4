// Umbrella header of the sparseattn C++ API.
#pragma once

#include "sparseattn/combine.h"
#include "sparseattn/compress_kv.h"
#include "sparseattn/compressed_attention.h"
#include "sparseattn/create_mask.h"
#include "sparseattn/error.h"
#include "sparseattn/flash_attention.h"
#include "sparseattn/flash_decode.h"
#include "sparseattn/head_dims.h"
#include "sparseattn/nsa_attention.h"
#include "sparseattn/nsa_decode.h"
#include "sparseattn/select_blocks.h"
#include "sparseattn/selected_attention.h"
#include "sparseattn/sequences.h"
#include "sparseattn/tensor.h"
#include "sparseattn/version.h"
