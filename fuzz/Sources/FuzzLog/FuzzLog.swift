import EntitlementsStore
import FuzzSupport

/// An arbitrary file as a write-ahead log: replay either works (possibly cutting a torn
/// tail) or throws.
@_cdecl("LLVMFuzzerTestOneInput")
public func fuzz(_ data: UnsafePointer<UInt8>, _ size: Int) -> CInt {
    withInputFile(data, size, suffix: ".log") { path in
        if let (log, _) = try? WriteAheadLog.open(path: path) {
            log.close()
        }
    }
    return 0
}
