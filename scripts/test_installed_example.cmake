# CTest driver (cmake -P): install the current build of sparseattn into a scratch prefix, then configure,
# build and run examples/cpp against it through find_package(sparseattn). This tests the install and
# export rules and the CMake package config the way a user meets them.
#
# Inputs (-D): BUILD_DIR (the sparseattn build tree), EXAMPLE_DIR, WORK_DIR (scratch, wiped first),
# GENERATOR, CXX_COMPILER; optional CONFIG (build type, default Release), MAKE_PROGRAM (the build tool
# the main build used) and CUDA_COMPILER (when the build used CUDA).
foreach(var BUILD_DIR EXAMPLE_DIR WORK_DIR GENERATOR CXX_COMPILER)
  if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
    message(FATAL_ERROR "test_installed_example.cmake: -D${var}=... is required")
  endif()
endforeach()

function(run_step name)
  message(STATUS "[${name}] ${ARGN}")
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "[${name}] failed (${rc})")
  endif()
endfunction()

if(NOT CONFIG)
  set(CONFIG Release)
endif()
file(REMOVE_RECURSE "${WORK_DIR}")
set(prefix "${WORK_DIR}/prefix")
set(example_build "${WORK_DIR}/build")

run_step(install "${CMAKE_COMMAND}" --install "${BUILD_DIR}" --prefix "${prefix}" --config "${CONFIG}")

set(configure_args -S "${EXAMPLE_DIR}" -B "${example_build}" -G "${GENERATOR}"
    "-DCMAKE_BUILD_TYPE=${CONFIG}" "-DCMAKE_PREFIX_PATH=${prefix}" "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}")
if(MAKE_PROGRAM)
  list(APPEND configure_args "-DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM}")
endif()
if(CUDA_COMPILER)
  # The package config looks for the CUDA toolkit (cudart) when the library was built with CUDA.
  get_filename_component(cuda_bin "${CUDA_COMPILER}" DIRECTORY)
  get_filename_component(cuda_root "${cuda_bin}" DIRECTORY)
  list(APPEND configure_args "-DCUDAToolkit_ROOT=${cuda_root}")
endif()
run_step(configure "${CMAKE_COMMAND}" ${configure_args})
run_step(build "${CMAKE_COMMAND}" --build "${example_build}" --config "${CONFIG}")

find_program(example_exe nsa_example PATHS "${example_build}" "${example_build}/${CONFIG}" NO_DEFAULT_PATH
             REQUIRED)
run_step(run "${example_exe}")
