#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

import EntitlementsFormats

/// A buffered text file writer (stdio), for the JSON files `snapshot generate --jsonl` writes.
struct TextFileWriter: ~Copyable {
    private let file: UnsafeMutablePointer<FILE>
    private let path: String
    private var closed = false

    init(path: String) throws {
        guard let file = fopen(path, "w") else {
            throw InputError(file: path, reason: "cannot create: \(String(cString: strerror(errno)))")
        }
        self.file = file
        self.path = path
    }

    deinit {
        if !self.closed {
            fclose(self.file)
        }
    }

    mutating func write(_ text: String) throws {
        var text = text
        let written = text.withUTF8 { fwrite($0.baseAddress, 1, $0.count, self.file) }
        guard written == text.utf8.count else {
            throw InputError(file: self.path, reason: "cannot write: \(String(cString: strerror(errno)))")
        }
    }

    consuming func close() throws {
        self.closed = true
        guard fclose(self.file) == 0 else {
            throw InputError(file: self.path, reason: "cannot write: \(String(cString: strerror(errno)))")
        }
    }
}
