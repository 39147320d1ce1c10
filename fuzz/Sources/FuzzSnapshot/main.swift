import FuzzSupport

runFuzzer { data, size in fuzz(data, size) }
