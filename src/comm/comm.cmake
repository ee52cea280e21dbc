# Sources and dependencies of the communication layer (src/comm), included
# from src/CMakeLists.txt. The layer is always built: the engine-independent
# half of every communicator, the tensor lists, the gradient arena, Adasum
# and the sharded optimizers over a Communicator need no engine. Its two
# engines are optional:
# - MPI (the MPI communicator, MpiEnvironment, and NCCL bootstrapped over
#   MPI) where it is found and GRADKIT_MPI is not OFF, linked privately;
#   without it mpi/no_mpi.cc and nccl/no_mpi.cc refuse those;
# - NCCL where the CUDA backend is built and nccl.h is found: only the
#   header is needed, the library is loaded at first use
#   (nccl/nccl_library.h), so libgradkit does not list it as DT_NEEDED;
#   without it no_nccl.cc and adasum/no_cuda.cc refuse.
# gradkit's public headers need neither mpi.h nor nccl.h.
target_sources(gradkit PRIVATE
  ${CMAKE_CURRENT_LIST_DIR}/../cpu/adasum.cc
  ${CMAKE_CURRENT_LIST_DIR}/adasum/adasum_plan.cc
  ${CMAKE_CURRENT_LIST_DIR}/adasum/schedule.cc
  ${CMAKE_CURRENT_LIST_DIR}/communicator.cc
  ${CMAKE_CURRENT_LIST_DIR}/fingerprint.cc
  ${CMAKE_CURRENT_LIST_DIR}/gradient_arena.cc
  ${CMAKE_CURRENT_LIST_DIR}/tensor_list.cc
  # The sharded optimizer is an optimizer over a communicator: it needs this layer.
  ${CMAKE_CURRENT_LIST_DIR}/../optim/sharded.cc
  ${CMAKE_CURRENT_LIST_DIR}/../optim/sharded_state.cc
  # Muon over shards, with its all-to-alls through a communicator.
  ${CMAKE_CURRENT_LIST_DIR}/../optim/muon_sharded_step.cc
)

set(GRADKIT_WITH_MPI OFF)
if(NOT GRADKIT_MPI STREQUAL "OFF")
  find_package(MPI COMPONENTS CXX)
  if(MPI_CXX_FOUND)
    set(GRADKIT_WITH_MPI ON)
  elseif(GRADKIT_MPI STREQUAL "ON")
    message(FATAL_ERROR "GRADKIT_MPI=ON but MPI (C++) was not found")
  endif()
endif()
# The MPI engine's sources (NCCL's bootstrap over MPI joins them below).
set(gradkit_mpi_sources
  ${CMAKE_CURRENT_LIST_DIR}/mpi/mpi_channel.cc
  ${CMAKE_CURRENT_LIST_DIR}/mpi/mpi_communicator.cc
  ${CMAKE_CURRENT_LIST_DIR}/mpi/mpi_environment.cc
)
if(GRADKIT_WITH_MPI)
  target_sources(gradkit PRIVATE ${gradkit_mpi_sources})
  # The library links MPI, but only the MPI engine's sources see mpi.h:
  # every other source compiles to the same object with or without MPI,
  # and one that used MPI outside the engine would not compile.
  target_link_libraries(gradkit PRIVATE $<LINK_ONLY:MPI::MPI_CXX>)
  # What a consumer may test (the Python module's bindings); the library's
  # own sources pick files instead (mpi/no_mpi.cc, nccl/no_mpi.cc).
  target_compile_definitions(gradkit INTERFACE GRADKIT_WITH_MPI=1)
else()
  target_sources(gradkit PRIVATE ${CMAKE_CURRENT_LIST_DIR}/mpi/no_mpi.cc)
endif()

set(GRADKIT_WITH_NCCL OFF)
if(GRADKIT_WITH_CUDA)
  # /usr/local/cuda where NCCL ships with the toolkit; /usr and the Debian
  # multiarch directory where it comes from the distribution's packages.
  find_path(GRADKIT_NCCL_INCLUDE_DIR nccl.h HINTS /usr/local/cuda/include /usr/include ${CUDAToolkit_INCLUDE_DIRS})
  # libgradkit does not link it; the tools that call NCCL themselves do
  # (tools/gradkit: gradkit-bench-comm).
  find_library(GRADKIT_NCCL_LIBRARY nccl HINTS /usr/local/cuda/lib64 /usr/lib/x86_64-linux-gnu ${CUDAToolkit_LIBRARY_DIR})
  if(GRADKIT_NCCL_INCLUDE_DIR)
    set(GRADKIT_WITH_NCCL ON)
  endif()
endif()

if(GRADKIT_WITH_NCCL)
  target_sources(gradkit PRIVATE
    ${CMAKE_CURRENT_LIST_DIR}/../cuda/adasum.cu
    ${CMAKE_CURRENT_LIST_DIR}/../cuda/nccl_divide.cu
    ${CMAKE_CURRENT_LIST_DIR}/../cuda/fusion_copy.cu
    ${CMAKE_CURRENT_LIST_DIR}/nccl/nccl_communicator.cc
    ${CMAKE_CURRENT_LIST_DIR}/nccl/nccl_create.cc
    ${CMAKE_CURRENT_LIST_DIR}/nccl/nccl_library.cc
    ${CMAKE_CURRENT_LIST_DIR}/nccl/nccl_list_reduce.cc
    ${CMAKE_CURRENT_LIST_DIR}/nccl/split_plan.cc
    ${CMAKE_CURRENT_LIST_DIR}/nccl/stream_order.cc
    ${CMAKE_CURRENT_LIST_DIR}/nccl/watchdog.cc
  )
  if(GRADKIT_WITH_MPI)
    list(APPEND gradkit_mpi_sources ${CMAKE_CURRENT_LIST_DIR}/nccl/nccl_create_mpi.cc)
    target_sources(gradkit PRIVATE ${CMAKE_CURRENT_LIST_DIR}/nccl/nccl_create_mpi.cc)
  else()
    target_sources(gradkit PRIVATE ${CMAKE_CURRENT_LIST_DIR}/nccl/no_mpi.cc)
  endif()
  target_include_directories(gradkit PRIVATE ${GRADKIT_NCCL_INCLUDE_DIR})
  target_compile_definitions(gradkit PUBLIC GRADKIT_WITH_NCCL=1)
else()
  target_sources(gradkit PRIVATE ${CMAKE_CURRENT_LIST_DIR}/no_nccl.cc ${CMAKE_CURRENT_LIST_DIR}/adasum/no_cuda.cc)
endif()
if(GRADKIT_WITH_MPI)
  # MPI's C API alone: its C++ bindings (deprecated, and warning under
  # -Wextra) are left out of mpi.h.
  set_source_files_properties(${gradkit_mpi_sources} PROPERTIES
    INCLUDE_DIRECTORIES "$<TARGET_PROPERTY:MPI::MPI_CXX,INTERFACE_INCLUDE_DIRECTORIES>"
    COMPILE_OPTIONS "$<TARGET_PROPERTY:MPI::MPI_CXX,INTERFACE_COMPILE_OPTIONS>"
    COMPILE_DEFINITIONS "$<TARGET_PROPERTY:MPI::MPI_CXX,INTERFACE_COMPILE_DEFINITIONS>;OMPI_SKIP_MPICXX=1;MPICH_SKIP_MPICXX=1")
endif()
message(STATUS "gradkit: communication layer with MPI ${GRADKIT_WITH_MPI}, NCCL ${GRADKIT_WITH_NCCL}")
set_property(GLOBAL PROPERTY GRADKIT_WITH_MPI ${GRADKIT_WITH_MPI})
set_property(GLOBAL PROPERTY GRADKIT_WITH_NCCL ${GRADKIT_WITH_NCCL})
