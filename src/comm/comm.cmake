# Sources and dependencies of the communication layer (src/comm), included
# from src/CMakeLists.txt. MPI (host collectives, and the bootstrap of NCCL)
# is required for the layer; without it the layer is left out. NCCL is used
# when the CUDA backend is built and nccl.h / libnccl are found. Both stay
# private: gradkit's public headers need neither mpi.h nor nccl.h.
find_package(MPI COMPONENTS CXX)
if(NOT MPI_CXX_FOUND)
  message(STATUS "gradkit: MPI not found, the communication layer (src/comm) is left out")
  set_property(GLOBAL PROPERTY GRADKIT_WITH_MPI OFF)
  set_property(GLOBAL PROPERTY GRADKIT_WITH_NCCL OFF)
  return()
endif()

target_sources(gradkit PRIVATE
  ${CMAKE_CURRENT_LIST_DIR}/../cpu/adasum.cc
  ${CMAKE_CURRENT_LIST_DIR}/adasum/adasum_plan.cc
  ${CMAKE_CURRENT_LIST_DIR}/adasum/schedule.cc
  ${CMAKE_CURRENT_LIST_DIR}/communicator.cc
  ${CMAKE_CURRENT_LIST_DIR}/fingerprint.cc
  ${CMAKE_CURRENT_LIST_DIR}/gradient_arena.cc
  ${CMAKE_CURRENT_LIST_DIR}/tensor_list.cc
  ${CMAKE_CURRENT_LIST_DIR}/mpi/mpi_channel.cc
  ${CMAKE_CURRENT_LIST_DIR}/mpi/mpi_communicator.cc
  ${CMAKE_CURRENT_LIST_DIR}/mpi/mpi_environment.cc
  # The sharded optimizer is an optimizer over a communicator: it needs this layer.
  ${CMAKE_CURRENT_LIST_DIR}/../optim/sharded.cc
  ${CMAKE_CURRENT_LIST_DIR}/../optim/sharded_state.cc
  # Muon over row shards, with its all-to-alls through a communicator.
  ${CMAKE_CURRENT_LIST_DIR}/../optim/muon_sharded_step.cc
)
target_link_libraries(gradkit PRIVATE MPI::MPI_CXX)
target_compile_definitions(gradkit PUBLIC GRADKIT_WITH_MPI=1)

set(GRADKIT_WITH_NCCL OFF)
if(GRADKIT_WITH_CUDA)
  # /usr/local/cuda where NCCL ships with the toolkit; /usr and the Debian
  # multiarch directory where it comes from the distribution's packages.
  find_path(GRADKIT_NCCL_INCLUDE_DIR nccl.h HINTS /usr/local/cuda/include /usr/include ${CUDAToolkit_INCLUDE_DIRS})
  find_library(GRADKIT_NCCL_LIBRARY nccl HINTS /usr/local/cuda/lib64 /usr/lib/x86_64-linux-gnu ${CUDAToolkit_LIBRARY_DIR})
  if(GRADKIT_NCCL_INCLUDE_DIR AND GRADKIT_NCCL_LIBRARY)
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
    ${CMAKE_CURRENT_LIST_DIR}/nccl/nccl_list_reduce.cc
    ${CMAKE_CURRENT_LIST_DIR}/nccl/split_plan.cc
    ${CMAKE_CURRENT_LIST_DIR}/nccl/stream_order.cc
    ${CMAKE_CURRENT_LIST_DIR}/nccl/watchdog.cc
  )
  target_include_directories(gradkit PRIVATE ${GRADKIT_NCCL_INCLUDE_DIR})
  # ${CMAKE_DL_LIBS}: the watchdog looks ncclCommRevoke up at run time (nccl/watchdog.cc).
  target_link_libraries(gradkit PRIVATE ${GRADKIT_NCCL_LIBRARY} ${CMAKE_DL_LIBS})
  target_compile_definitions(gradkit PUBLIC GRADKIT_WITH_NCCL=1)
  message(STATUS "gradkit: communication layer with MPI and NCCL (${GRADKIT_NCCL_LIBRARY})")
else()
  target_sources(gradkit PRIVATE ${CMAKE_CURRENT_LIST_DIR}/no_nccl.cc ${CMAKE_CURRENT_LIST_DIR}/adasum/no_cuda.cc)
  message(STATUS "gradkit: communication layer with MPI only (NCCL needs the CUDA backend and nccl.h/libnccl)")
endif()
set_property(GLOBAL PROPERTY GRADKIT_WITH_MPI ON)
set_property(GLOBAL PROPERTY GRADKIT_WITH_NCCL ${GRADKIT_WITH_NCCL})
