#if canImport(Glibc)
import Glibc
#endif

@_silgen_name("LLVMFuzzerRunDriver")
func LLVMFuzzerRunDriver(
    _ argc: UnsafeMutablePointer<Int32>,
    _ argv: UnsafeMutablePointer<UnsafeMutablePointer<UnsafeMutablePointer<CChar>?>>,
    _ callback: @convention(c) (UnsafePointer<UInt8>, Int) -> Int32
) -> Int32

/// Runs libFuzzer's driver with `target`. SwiftPM renames an executable's entry point
/// after its module, so libFuzzer's own `main` is not the one linked: each target's
/// main.swift calls this instead.
public func runFuzzer(_ target: @convention(c) (UnsafePointer<UInt8>, Int) -> Int32) -> Never {
    var argc = CommandLine.argc
    var argv = CommandLine.unsafeArgv
    exit(LLVMFuzzerRunDriver(&argc, &argv, target))
}

/// Writes the fuzzer's input to a temporary file, runs `body` with its path, removes it.
public func withInputFile(_ data: UnsafePointer<UInt8>, _ size: Int, suffix: String, _ body: (String) -> Void) {
    let path = "/tmp/fuzz-\(getpid())\(suffix)"
    let fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0o644)
    _ = write(fd, data, size)
    close(fd)
    defer { unlink(path) }
    body(path)
}
