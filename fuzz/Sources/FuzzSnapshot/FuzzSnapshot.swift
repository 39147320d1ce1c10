import EntitlementsStore
import FuzzSupport

/// An arbitrary file as a snapshot: opening, looking up and verifying either work or throw.
@_cdecl("LLVMFuzzerTestOneInput")
public func fuzz(_ data: UnsafePointer<UInt8>, _ size: Int) -> CInt {
    withInputFile(data, size, suffix: ".snap") { path in
        guard let reader = try? SnapshotReader(path: path) else { return }
        for key in ["user-1", "user-2", "$anon:abc", ""] + reader.hotList.prefix(8) {
            _ = try? reader.customer(for: key)
        }
        _ = try? reader.verifyRecords()
    }
    return 0
}
