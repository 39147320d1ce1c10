#if canImport(Glibc)
import Glibc
#elseif canImport(Musl)
import Musl
#elseif canImport(Darwin)
import Darwin
#endif

/// Reads a text file line by line without loading it whole (getline), so that a
/// customers.jsonl of millions of lines streams in constant memory.
struct LineReader: ~Copyable {
    private let file: UnsafeMutablePointer<FILE>
    private var buffer: UnsafeMutablePointer<CChar>? = nil
    private var capacity = 0
    /// The 1-based number of the line last returned.
    private(set) var lineNumber = 0

    /// Opens `path`; throws an InputError naming the file and the system's reason.
    init(path: String) throws(InputError) {
        guard let file = fopen(path, "r") else {
            let reason = String(cString: strerror(errno))
            throw InputError(file: path, reason: "cannot open: \(reason)")
        }
        self.file = file
    }

    deinit {
        free(self.buffer)
        fclose(self.file)
    }

    /// The next line's bytes without its line ending, or nil at the end of the file.
    mutating func nextLine() -> [UInt8]? {
        let count = getline(&self.buffer, &self.capacity, self.file)
        guard count >= 0, let buffer = self.buffer else {
            return nil
        }
        self.lineNumber += 1
        var length = count
        while length > 0, buffer[length - 1] == 0x0A || buffer[length - 1] == 0x0D {
            length -= 1
        }
        return buffer.withMemoryRebound(to: UInt8.self, capacity: length) { Array(UnsafeBufferPointer(start: $0, count: length)) }
    }
}
