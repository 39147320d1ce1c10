#if canImport(Glibc)
import Glibc
#endif
import EntitlementsStore
import FuzzSupport

/// An arbitrary file as a write-ahead log segment (format 1 or 2): replay either works
/// (possibly setting a torn tail aside) or throws.
@_cdecl("LLVMFuzzerTestOneInput")
public func fuzz(_ data: UnsafePointer<UInt8>, _ size: Int) -> CInt {
    withInputFile(data, size, suffix: ".log") { path in
        if let replay = try? WriteAheadLog.replaySegment(path: path), let side = replay.tornSideFile {
            unlink(side)  // the side file replay keeps, here one per input
        }
    }
    return 0
}
