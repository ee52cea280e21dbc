# Sources and dependencies of the communication layer (src/comm), included
# from src/CMakeLists.txt. Filled in by the communication work.
