/// What every id a request or an input file names must be (docs/PROTOCOL.md, section 9,
/// "Ids"): customer ids and aliases, and product, entitlement, transaction and grant ids.
///
/// An id is 1 to ``maximumBytes`` bytes of UTF-8 in Unicode Normalization Form C (NFC).
/// The snapshot, the cache and PostgreSQL tell ids apart by their bytes, but a Swift
/// `String` compares by canonical equivalence: "é" as U+00E9 and as "e" followed by U+0301
/// are equal strings with different bytes. Every equivalence class has exactly one NFC
/// member, so among NFC ids the two comparisons agree, and a customer cannot be found
/// under another customer's id in one place and not in another.
public enum IdRule {
    /// The longest id accepted, in UTF-8 bytes.
    public static let maximumBytes = 256

    /// Why `id` is not an acceptable id, for a message that names the field first
    /// (`user_id: must not be empty`), or nil when it is one.
    public static func problem(_ id: String) -> String? {
        let count = id.utf8.count
        guard count > 0 else {
            return "must not be empty"
        }
        guard count <= Self.maximumBytes else {
            return "must be at most \(Self.maximumBytes) bytes, got \(count)"
        }
        guard Self.isNFC(id) else {
            return "must be in Unicode Normalization Form C (NFC), e.g. U+00E9, not e followed by U+0301; normalize it to NFC"
        }
        return nil
    }

    /// Whether `id` is in NFC; true without a table lookup for ASCII and for strings the
    /// standard library already knows to be NFC.
    public static func isNFC(_ id: String) -> Bool {
        var span = id.utf8Span
        return span.isKnownNFC || span.checkForNFC(quickCheck: false)
    }
}
