public import EntitlementsMessages
public import EntitlementsResolver
public import NIOCore

/// Which answer a request asks for: the canonical customer and the request's shape. Two
/// requests share a cache entry only if all three parts are equal; the entitlement filter
/// is sorted and deduplicated, so `["pro", "premium"]` and `["premium", "pro", "pro"]` do.
public struct CacheKey: Hashable, Sendable {
    /// The canonical customer id (never an alias).
    public let customerId: String
    /// Production or sandbox; unspecified is normalised to production.
    public let environment: Environment
    /// The requested entitlements, sorted and unique; empty means all.
    public let entitlementFilter: [String]

    /// Creates a key, normalising the environment and the filter.
    public init(customerId: String, environment: Environment = .production, entitlementIds: [String] = []) {
        self.customerId = customerId
        self.environment = environment == .unspecified ? .production : environment
        self.entitlementFilter = entitlementIds.count < 2 ? entitlementIds : Array(Set(entitlementIds)).sorted()
    }

    /// Keys are equal when their ids' bytes are: the store tells customers apart by bytes,
    /// so two ids that Swift's `String ==` deems equivalent (é as one scalar or as e and a
    /// combining accent) are two customers and must not share an answer.
    public static func == (a: CacheKey, b: CacheKey) -> Bool {
        a.environment == b.environment
            && Self.sameBytes(a.customerId, b.customerId)
            && a.entitlementFilter.count == b.entitlementFilter.count
            && zip(a.entitlementFilter, b.entitlementFilter).allSatisfy { Self.sameBytes($0, $1) }
    }

    public func hash(into hasher: inout Hasher) {
        var customerId = self.customerId
        customerId.withUTF8 { Self.combine(customerId: UnsafeRawBufferPointer($0), environment: self.environment, filter: self.entitlementFilter, into: &hasher) }
    }

    /// What ``hash(into:)`` feeds the hasher, from the id's bytes (``CachePeek`` hashes a
    /// request's key without making a String of its id).
    package static func combine(customerId: UnsafeRawBufferPointer, environment: Environment, filter: [String], into hasher: inout Hasher) {
        hasher.combine(bytes: customerId)
        hasher.combine(environment.rawValue)
        hasher.combine(filter.count)
        for var id in filter {
            hasher.combine(id.utf8.count)
            id.withUTF8 { hasher.combine(bytes: UnsafeRawBufferPointer($0)) }
        }
    }

    private static func sameBytes(_ a: String, _ b: String) -> Bool {
        var a = a
        var b = b
        return a.withUTF8 { a in b.withUTF8 { b in a.count == b.count && a.elementsEqual(b) } }
    }

    /// The bytes the key's strings occupy, for the cache's accounting.
    var byteCount: Int {
        self.customerId.utf8.count + self.entitlementFilter.reduce(0) { $0 + $1.utf8.count + 16 }
    }
}

/// A resolved answer in its wire form, ready to send: the encoded `entitlements` entries
/// of a CheckEntitlementsResponse (field 5), valid for evaluation instants in
/// [`resolvedAt`, `validUntil`).
///
/// Protobuf messages may be concatenated field by field, so a response is the few bytes
/// of its per-request fields (user id, customer id, request date, validUntil) followed by
/// these bytes, byte-for-byte what encoding the whole message would give.
public struct CachedAnswer: Sendable, Hashable {
    /// The encoded `repeated Entitlement entitlements = 5` entries.
    public let encodedEntitlements: [UInt8]
    /// The instant the answer was resolved at; it is exact from there.
    public let resolvedAt: Int64
    /// The instant from which the answer may be wrong; nil if never.
    public let validUntil: Int64?
    /// The log sequence the customer's record was read at: every write up to it is in this
    /// answer. A cached answer keeps the sequence it was read at; a later write to the
    /// customer removes it from the cache before that write is acknowledged.
    public let logSequence: UInt64

    /// Encodes `resolution`, resolved at `resolvedAt` from a record read at `logSequence`.
    public init(_ resolution: Resolution, resolvedAt: Int64, logSequence: UInt64 = 0) throws {
        self.encodedEntitlements = try CheckEntitlementsResponse(entitlements: resolution.entitlements).serializedBytes()
        self.resolvedAt = resolvedAt
        self.validUntil = resolution.validUntil
        self.logSequence = logSequence
    }

    /// The answer with no entitlements (an unknown user), valid from `resolvedAt` on.
    public static func empty(resolvedAt: Int64, logSequence: UInt64 = 0) -> CachedAnswer {
        CachedAnswer(encodedEntitlements: [], resolvedAt: resolvedAt, validUntil: nil, logSequence: logSequence)
    }

    /// Whether the answer is exact at `instant`.
    public func isValid(at instant: Int64) -> Bool {
        self.resolvedAt <= instant && self.validUntil.map { instant < $0 } ?? true
    }

    /// Appends the encoded CheckEntitlementsResponse for this answer to `buffer`: the
    /// per-request fields, then the cached bytes, in one reservation and one pass.
    /// `staleForMilliseconds` (not 0: a fleet server past its --max-staleness, answering
    /// anyway) sets `stale_for_ms`.
    public func writeResponse(userId: String, customerId: String?, requestDate: Int64, staleForMilliseconds: UInt64 = 0, into buffer: inout ByteBuffer) {
        var userId = userId
        let hasCustomer = customerId != nil
        var customerId = customerId ?? ""
        let most = self.responseReservation(userId: userId, customerId: customerId)
        buffer.writeWithUnsafeMutableBytes(minimumWritableBytes: most) { out in
            var writer = ProtobufWriter(out: out)
            writer.string(field: 1, &userId)
            if hasCustomer {
                writer.string(field: 2, &customerId)
            }
            writer.tag(field: 3, wireType: 0)
            writer.varint(UInt64(bitPattern: requestDate))
            if let validUntil = self.validUntil {
                writer.tag(field: 4, wireType: 0)
                writer.varint(UInt64(bitPattern: validUntil))
            }
            self.encodedEntitlements.withUnsafeBytes { writer.bytes($0) }
            if self.logSequence != 0 {
                writer.tag(field: 6, wireType: 0)
                writer.varint(self.logSequence)
            }
            if staleForMilliseconds != 0 {
                writer.tag(field: 7, wireType: 0)
                writer.varint(staleForMilliseconds)
            }
            return writer.position
        }
    }

    /// The room ``writeResponse(userId:customerId:requestDate:staleForMilliseconds:into:)``
    /// reserves before it writes: every field at its largest encoding (two strings with a tag
    /// and up to 5 length bytes, four 64-bit fields with a tag and up to 10 bytes). A buffer
    /// made for one response with this much room is never grown.
    public func responseReservation(userId: String, customerId: String?) -> Int {
        12 + userId.utf8.count + (customerId?.utf8.count ?? 0) + 44 + self.encodedEntitlements.count
    }

    /// The exact number of bytes ``writeResponse(userId:customerId:requestDate:staleForMilliseconds:into:)``
    /// appends with the same arguments: a frame's header, which holds it, is written before
    /// the answer (the fields 1 to 7 all have one-byte tags).
    public func responseByteCount(userId: String, customerId: String?, requestDate: Int64, staleForMilliseconds: UInt64 = 0) -> Int {
        func string(_ bytes: Int) -> Int {
            1 + ProtobufWriter.varintByteCount(UInt64(bytes)) + bytes
        }
        func varint(_ value: UInt64) -> Int {
            1 + ProtobufWriter.varintByteCount(value)
        }
        var count = string(userId.utf8.count) + varint(UInt64(bitPattern: requestDate)) + self.encodedEntitlements.count
        if let customerId {
            count += string(customerId.utf8.count)
        }
        if let validUntil = self.validUntil {
            count += varint(UInt64(bitPattern: validUntil))
        }
        if self.logSequence != 0 {
            count += varint(self.logSequence)
        }
        if staleForMilliseconds != 0 {
            count += varint(staleForMilliseconds)
        }
        return count
    }

    /// The response as a message (decodes what ``writeResponse(userId:customerId:requestDate:into:)`` writes).
    public func response(userId: String, customerId: String?, requestDate: Int64) throws -> CheckEntitlementsResponse {
        var buffer = ByteBuffer()
        self.writeResponse(userId: userId, customerId: customerId, requestDate: requestDate, into: &buffer)
        return try CheckEntitlementsResponse(buffer: buffer)
    }
}
