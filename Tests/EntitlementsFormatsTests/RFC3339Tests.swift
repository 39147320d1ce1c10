import Testing

@testable import EntitlementsFormats

@Suite("RFC 3339")
struct RFC3339Tests {
    static let valid: [(String, Int64)] = [
        ("1970-01-01T00:00:00Z", 0),
        ("2026-01-31T12:00:00Z", 1_769_860_800_000),
        ("2026-01-31T12:00:00.5Z", 1_769_860_800_500),
        ("2026-01-31T12:00:00.123Z", 1_769_860_800_123),
        ("2026-01-31T12:00:00.123999Z", 1_769_860_800_123),  // truncated, not rounded
        ("2026-01-31T14:30:00+02:30", 1_769_860_800_000),
        ("2026-01-31T07:00:00-05:00", 1_769_860_800_000),
        ("2026-01-31t12:00:00z", 1_769_860_800_000),
        ("2024-02-29T00:00:00Z", 1_709_164_800_000),  // leap day
        ("2000-02-29T00:00:00Z", 951_782_400_000),  // divisible by 400
        ("1969-12-31T23:59:59.999Z", -1),
        ("2016-12-31T23:59:60Z", 1_483_228_800_000),  // leap second: the next minute
    ]

    @Test("parses", arguments: valid)
    func parses(text: String, milliseconds: Int64) {
        #expect(RFC3339.parse(text) == milliseconds)
    }

    static let invalid = [
        "", "2026-01-31", "2026-01-31T12:00:00", "2026-01-31 12:00:00Z", "2026-1-31T12:00:00Z",
        "2026-13-01T00:00:00Z", "2026-00-01T00:00:00Z", "2026-02-29T00:00:00Z", "1900-02-29T00:00:00Z",
        "2026-04-31T00:00:00Z", "2026-01-31T24:00:00Z", "2026-01-31T12:60:00Z", "2026-01-31T12:00:61Z",
        "2026-01-31T12:00:00.Z", "2026-01-31T12:00:00+0200", "2026-01-31T12:00:00+24:00", "2026-01-31T12:00:00Zjunk",
        "２０２６-01-31T12:00:00Z", "yesterday",
    ]

    @Test("rejects", arguments: invalid)
    func rejects(text: String) {
        #expect(RFC3339.parse(text) == nil)
    }

    @Test("formats in UTC with milliseconds", arguments: [
        (Int64(0), "1970-01-01T00:00:00.000Z"),
        (1_769_860_800_123, "2026-01-31T12:00:00.123Z"),
        (-1, "1969-12-31T23:59:59.999Z"),
        (951_782_400_000, "2000-02-29T00:00:00.000Z"),
        (253_402_300_799_999, "9999-12-31T23:59:59.999Z"),
    ])
    func formats(milliseconds: Int64, text: String) {
        #expect(RFC3339.format(milliseconds) == text)
    }

    @Test("format and parse are inverse over four centuries of days")
    func roundTrip() {
        var milliseconds: Int64 = -6_000_000_000_000
        while milliseconds < 7_000_000_000_000 {
            #expect(RFC3339.parse(RFC3339.format(milliseconds)) == milliseconds)
            milliseconds += 86_400_000 * 7 + 3_723_456
        }
    }
}
