// libFuzzer's driver, called from this executable's own entry point (SwiftPM names the
// entry point after the module, so libFuzzer's `main` is not the one linked).
#if canImport(Glibc)
import Glibc
#endif

@_silgen_name("LLVMFuzzerRunDriver")
func LLVMFuzzerRunDriver(
    _ argc: UnsafeMutablePointer<Int32>,
    _ argv: UnsafeMutablePointer<UnsafeMutablePointer<UnsafeMutablePointer<CChar>?>>,
    _ callback: @convention(c) (UnsafePointer<UInt8>, Int) -> Int32
) -> Int32

var argc = CommandLine.argc
var argv = CommandLine.unsafeArgv
exit(LLVMFuzzerRunDriver(&argc, &argv) { data, size in fuzz(data, size) })
