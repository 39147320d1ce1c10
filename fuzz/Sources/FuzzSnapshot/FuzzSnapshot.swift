import EntitlementsStore
import Glibc

/// An arbitrary file as a snapshot: opening, looking up and verifying either work or throw.

@_cdecl("LLVMFuzzerTestOneInput")
public func fuzz(_ data: UnsafePointer<UInt8>, _ size: Int) -> CInt {
    let path = "/tmp/fuzz-snapshot-\(getpid()).snap"
    let fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0o644)
    _ = write(fd, data, size)
    close(fd)
    defer { unlink(path) }
    guard let reader = try? SnapshotReader(path: path) else { return 0 }
    for key in ["user-1", "user-2", "$anon:abc", ""] + reader.hotList.prefix(8) {
        _ = try? reader.customer(for: key)
    }
    _ = try? reader.verifyRecords()
    return 0
}
