import CEntitlementsShim

#if canImport(Glibc)
import Glibc
#elseif canImport(Musl)
import Musl
#elseif canImport(Darwin)
import Darwin
#endif

/// A file read and written by offset (pread/pwrite), so that concurrent readers need no
/// lock and nothing is held in memory but what is being read. Errors are SnapshotErrors
/// naming the path and the system's reason.
final class FileDescriptor: Sendable {
    let fd: Int32
    let path: String

    private init(fd: Int32, path: String) {
        self.fd = fd
        self.path = path
    }

    deinit {
        close(self.fd)
    }

    static func openForReading(_ path: String) throws -> FileDescriptor {
        let fd = open(path, O_RDONLY | O_CLOEXEC)
        guard fd >= 0 else {
            throw Self.error(path, "cannot open")
        }
        return FileDescriptor(fd: fd, path: path)
    }

    /// Creates `path` exclusively (it must not exist) for writing and reading back.
    static func create(_ path: String) throws -> FileDescriptor {
        let fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0o644)
        guard fd >= 0 else {
            throw Self.error(path, "cannot create")
        }
        return FileDescriptor(fd: fd, path: path)
    }

    func size() throws -> UInt64 {
        var status = stat()
        guard fstat(self.fd, &status) == 0 else {
            throw Self.error(self.path, "cannot stat")
        }
        return UInt64(status.st_size)
    }

    /// One pread, or with `mayWait` false one that does not wait for the disk: it throws
    /// ``WouldWait`` when the bytes are not in memory (RWF_NOWAIT).
    private func pread(_ buffer: UnsafeMutableRawPointer, _ count: Int, _ offset: UInt64, mayWait: Bool) throws -> Int {
        guard !mayWait else {
            return Glibc.pread(self.fd, buffer, count, off_t(offset))
        }
        let result = ent_pread_nowait(self.fd, buffer, count, Int64(offset))
        if result < 0, errno != EINTR {
            throw WouldWait()
        }
        return result
    }

    /// Reads exactly `count` bytes at `offset` into `buffer`; throws `.truncated` if the
    /// file ends first.
    func read(into buffer: UnsafeMutableRawBufferPointer, count: Int, at offset: UInt64, mayWait: Bool = true) throws {
        precondition(count <= buffer.count)
        var done = 0
        while done < count {
            let result = try self.pread(buffer.baseAddress! + done, count - done, offset + UInt64(done), mayWait: mayWait)
            if result < 0 {
                if errno == EINTR { continue }
                throw Self.error(self.path, "cannot read \(count) bytes at offset \(offset)")
            }
            if result == 0 {
                throw SnapshotError(
                    code: .truncated,
                    path: self.path,
                    offset: offset + UInt64(done),
                    reason: "the file ends \(count - done) bytes short of what its header describes"
                )
            }
            done += result
        }
    }

    func read(count: Int, at offset: UInt64, mayWait: Bool = true) throws -> [UInt8] {
        try [UInt8](unsafeUninitializedCapacity: count) { buffer, initialized in
            try self.read(into: UnsafeMutableRawBufferPointer(buffer), count: count, at: offset, mayWait: mayWait)
            initialized = count
        }
    }

    /// Reads up to `count` bytes at `offset`, fewer only at the end of the file.
    func readUpTo(into buffer: UnsafeMutableRawBufferPointer, count: Int, at offset: UInt64, mayWait: Bool = true) throws -> Int {
        var done = 0
        while done < count {
            let result = try self.pread(buffer.baseAddress! + done, count - done, offset + UInt64(done), mayWait: mayWait)
            if result < 0 {
                if errno == EINTR { continue }
                throw Self.error(self.path, "cannot read at offset \(offset)")
            }
            if result == 0 { break }
            done += result
        }
        return done
    }

    func write(_ bytes: UnsafeRawBufferPointer, at offset: UInt64) throws {
        var done = 0
        while done < bytes.count {
            let result = pwrite(self.fd, bytes.baseAddress! + done, bytes.count - done, off_t(offset) + off_t(done))
            if result < 0 {
                if errno == EINTR { continue }
                throw Self.error(self.path, "cannot write at offset \(offset)")
            }
            done += result
        }
    }

    func sync() throws {
        guard fsync(self.fd) == 0 else {
            throw Self.error(self.path, "cannot fsync")
        }
    }

    /// Creates the directory `path` if it does not exist, and then fsyncs its parent, so
    /// that the new directory (and what is later made durable in it) survives a power loss.
    /// `what` names it in the error ("the log directory").
    static func makeDirectory(_ path: String, what: String) throws {
        guard mkdir(path, 0o755) == 0 else {
            guard errno == EEXIST else {
                throw SnapshotError(code: .io, path: path, reason: "cannot create \(what): \(String(cString: strerror(errno)))")
            }
            return
        }
        var trimmed = Substring(path)
        while trimmed.count > 1, trimmed.hasSuffix("/") {
            trimmed = trimmed.dropLast()
        }
        try Self.syncDirectory(of: String(trimmed))
    }

    /// fsyncs the directory holding `path`, so that a rename into it is durable.
    static func syncDirectory(of path: String) throws {
        let directory = path.contains("/") ? String(path[..<path.lastIndex(of: "/")!]) : "."
        let fd = open(directory.isEmpty ? "/" : directory, O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        guard fd >= 0 else {
            throw Self.error(directory, "cannot open the directory to fsync it")
        }
        defer { close(fd) }
        guard fsync(fd) == 0 else {
            throw Self.error(directory, "cannot fsync the directory")
        }
    }

    /// Atomically replaces `to` with `from` (rename(2)).
    static func move(_ from: String, to: String) throws {
        guard rename(from, to) == 0 else {
            throw Self.error(to, "cannot rename \(from) to it")
        }
    }

    /// The names in `directory` (not `.` and `..`); none when it does not exist and
    /// `missingIsEmpty`. `what` names the directory in the error.
    static func names(in directory: String, what: String, missingIsEmpty: Bool = false) throws -> [String] {
        guard let handle = opendir(directory) else {
            if missingIsEmpty, errno == ENOENT { return [] }
            throw SnapshotError(code: .io, path: directory, reason: "cannot list the \(what): \(String(cString: strerror(errno)))")
        }
        defer { closedir(handle) }
        var names: [String] = []
        while let entry = readdir(handle) {
            let name = withUnsafeBytes(of: entry.pointee.d_name) { raw in
                String(decoding: raw.prefix { $0 != 0 }, as: UTF8.self)
            }
            if name != ".", name != ".." {
                names.append(name)
            }
        }
        return names
    }

    static func remove(_ path: String) {
        unlink(path)
    }

    static func error(_ path: String, _ what: String) -> SnapshotError {
        let reason = String(cString: strerror(errno))
        return SnapshotError(code: .io, path: path, reason: "\(what): \(reason)")
    }
}

/// A read asked not to wait for the disk would have: its bytes are not in memory.
public struct WouldWait: Error, CustomStringConvertible {
    public var description: String { "the read would wait for the disk" }
}
