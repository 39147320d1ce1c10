import EntitlementsStore
import Glibc

/// An arbitrary file as a write-ahead log: replay either works (possibly cutting a torn
/// tail) or throws.

@_cdecl("LLVMFuzzerTestOneInput")
public func fuzz(_ data: UnsafePointer<UInt8>, _ size: Int) -> CInt {
    let path = "/tmp/fuzz-log-\(getpid()).log"
    let fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0o644)
    _ = write(fd, data, size)
    close(fd)
    defer { unlink(path) }
    if let (log, _) = try? WriteAheadLog.open(path: path) {
        log.close()
    }
    return 0
}
