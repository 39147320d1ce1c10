import EntitlementsStore
import FuzzSupport

/// An arbitrary file as a write-ahead log segment: replay either works (possibly cutting a
/// torn tail) or throws.
@_cdecl("LLVMFuzzerTestOneInput")
public func fuzz(_ data: UnsafePointer<UInt8>, _ size: Int) -> CInt {
    withInputFile(data, size, suffix: ".log") { path in
        _ = try? WriteAheadLog.replaySegment(path: path)
    }
    return 0
}
