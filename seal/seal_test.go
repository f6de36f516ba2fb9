package seal

import (
	"bytes"
	"errors"
	"strings"
	"sync"
	"testing"
)

// ring12 holds k1 and k0 (whose ids differ in one bit) and k2, primary k1.
func ring12(t testing.TB) *Ring {
	_, a := testKey(1)
	_, z := testKey(0)
	_, b := testKey(2)
	return mustRing(t, "k1 "+a+"\nk0 "+z+"\nk2 "+b)
}

func TestSealOpenRoundTrip(t *testing.T) {
	r := ring12(t)
	for _, n := range []int{0, 1, 15, 16, 17, 1 << 10, 100_000} {
		plain := bytes.Repeat([]byte("card 4111 1111 1111 1111;"), n/25+1)[:n]
		for _, ad := range [][]byte{nil, []byte("idem/record\x00key")} {
			prefix := []byte("prefix")
			sealed := mustSeal(t, r, prefix, plain, ad)
			if !bytes.Equal(sealed[:len(prefix)], prefix) {
				t.Fatalf("Seal did not keep dst's bytes: %q", sealed[:len(prefix)])
			}
			sealed = sealed[len(prefix):]
			if got, want := len(sealed), n+r.Overhead(); got != want {
				t.Errorf("len(Seal(%d bytes)) = %d; want %d (plaintext + Overhead)", n, got, want)
			}
			if !IsSealed(sealed) {
				t.Errorf("IsSealed(Seal(%d bytes)) = false; want true", n)
			}
			if n >= 16 && bytes.Contains(sealed, plain[:16]) {
				t.Errorf("sealed value of %d bytes holds its plaintext in clear", n)
			}
			got, err := r.Open([]byte("x"), sealed, ad)
			if err != nil {
				t.Fatalf("Open(Seal(%d bytes), ad %q): %v", n, ad, err)
			}
			if got[0] != 'x' || !bytes.Equal(got[1:], plain) {
				t.Errorf("Open(Seal(%d bytes)) = %d bytes, not dst then the plaintext", n, len(got))
			}
		}
	}
	p := []byte("same")
	if a, b := mustSeal(t, r, nil, p, nil), mustSeal(t, r, nil, p, nil); bytes.Equal(a, b) {
		t.Error("two Seals of one plaintext are equal; want distinct (random nonces)")
	}
}

func TestRotation(t *testing.T) {
	_, a := testKey(1)
	_, b := testKey(2)
	old := mustRing(t, "k1 "+a)
	rotated := mustRing(t, "k2 "+b+"\nk1 "+a)
	retired := mustRing(t, "k2 "+b)
	ad := []byte("ad")
	plain := []byte(`{"card":"4111 1111 1111 1111","cvv":"123"}`)

	byK1 := mustSeal(t, old, nil, plain, ad)
	if got, err := rotated.Open(nil, byK1, ad); err != nil || !bytes.Equal(got, plain) {
		t.Errorf("ring with k2 primary: Open of what k1 sealed = %q, %v; want the plaintext", got, err)
	}
	byK2 := mustSeal(t, rotated, nil, plain, ad)
	if got, err := retired.Open(nil, byK2, ad); err != nil || !bytes.Equal(got, plain) {
		t.Errorf("ring of k2 alone: Open of what k2 sealed = %q, %v; want the plaintext", got, err)
	}
	_, err := retired.Open(nil, byK1, ad)
	if !errors.Is(err, ErrUnknownKey) {
		t.Fatalf("ring without k1: Open of what k1 sealed: error %v; want ErrUnknownKey", err)
	}
	if !strings.Contains(err.Error(), "key id k1 ") {
		t.Errorf("ErrUnknownKey error %q does not name the key id k1", err)
	}
	// A ring where the sealing key rotated down to the old ring: k2 unknown.
	if _, err := old.Open(nil, byK2, ad); !errors.Is(err, ErrUnknownKey) || !strings.Contains(err.Error(), "k2") {
		t.Errorf("ring of k1 alone: Open of what k2 sealed: error %v; want ErrUnknownKey naming k2", err)
	}
	// The same id over another key (another deployment's ring): tampered.
	_, c := testKey(3)
	if _, err := mustRing(t, "k1 "+c).Open(nil, byK1, ad); !errors.Is(err, ErrTampered) {
		t.Errorf("id k1 over another key: error %v; want ErrTampered", err)
	}
}

// TestFlippedBit flips every bit of a sealed value in turn: none opens.
// A flip in the header, nonce, ciphertext or tag is ErrTampered; one in
// the key id or its length is ErrTampered (not an id, or another key of
// the ring: k1's last bit flipped is k0) or ErrUnknownKey (an id the ring
// lacks).
func TestFlippedBit(t *testing.T) {
	r := ring12(t)
	ad := []byte("record/key")
	sealed := mustSeal(t, r, nil, []byte("X-Session-Token: tok-for-canary"), ad)
	idAt, idEnd := headerMin, headerMin+len(r.Primary())
	mod := make([]byte, len(sealed))
	var unknown, tampered int
	for i := range sealed {
		for bit := range 8 {
			copy(mod, sealed)
			mod[i] ^= 1 << bit
			got, err := r.Open(nil, mod, ad)
			switch {
			case err == nil:
				t.Fatalf("byte %d bit %d flipped: Open = %q, nil; want an error", i, bit, got)
			case errors.Is(err, ErrTampered):
				tampered++
			case errors.Is(err, ErrUnknownKey) && i >= idAt-1 && i < idEnd:
				// The id, or its length (a longer id takes in nonce
				// bytes, which may be id characters).
				unknown++
			default:
				t.Fatalf("byte %d bit %d flipped: error %v; want ErrTampered", i, bit, err)
			}
		}
	}
	if unknown == 0 || tampered < 8*(len(sealed)-3) {
		t.Errorf("flips: %d ErrTampered, %d ErrUnknownKey; want ErrTampered for all but some of the id's and its length's 24 bits", tampered, unknown)
	}
	copy(mod, sealed)
	mod[idEnd-1] ^= 1 // k1 → k0, a key of the ring
	if _, err := r.Open(nil, mod, ad); !errors.Is(err, ErrTampered) {
		t.Errorf("id k1 changed to k0 (in the ring): error %v; want ErrTampered", err)
	}
}

func TestOtherAD(t *testing.T) {
	r := ring12(t)
	sealed := mustSeal(t, r, nil, []byte("body"), []byte("name\x00key-A"))
	for _, ad := range [][]byte{nil, []byte("name\x00key-B"), []byte("name\x00key-A\x00"), []byte("name\x00key-")} {
		if _, err := r.Open(nil, sealed, ad); !errors.Is(err, ErrTampered) {
			t.Errorf("Open under ad %q (sealed under %q): error %v; want ErrTampered", ad, "name\x00key-A", err)
		}
	}
}

func TestTruncatedAndMalformed(t *testing.T) {
	r := ring12(t)
	ad := []byte("ad")
	sealed := mustSeal(t, r, nil, []byte("0123456789abcdef0123456789"), ad)
	for n := range len(sealed) {
		if got, err := r.Open(nil, sealed[:n], ad); !errors.Is(err, ErrTampered) {
			t.Errorf("Open of the first %d of %d bytes = %q, %v; want ErrTampered", n, len(sealed), got, err)
		}
	}
	longer := append(bytes.Clone(sealed), 0)
	if _, err := r.Open(nil, longer, ad); !errors.Is(err, ErrTampered) {
		t.Errorf("Open with a byte appended: error %v; want ErrTampered", err)
	}
	v2 := bytes.Clone(sealed)
	v2[len(magic)] = 2
	if _, err := r.Open(nil, v2, ad); !errors.Is(err, ErrTampered) || !strings.Contains(err.Error(), "version 2") {
		t.Errorf("Open of version 2: error %v; want ErrTampered naming version 2", err)
	}
	for _, n := range []byte{0, MaxIDLen + 1, 255} {
		bad := bytes.Clone(sealed)
		bad[len(magic)+1] = n
		if _, err := r.Open(nil, bad, ad); !errors.Is(err, ErrTampered) {
			t.Errorf("Open with key id length %d: error %v; want ErrTampered", n, err)
		}
	}
	if _, err := r.Open(nil, []byte(`{"status":200}`), ad); !errors.Is(err, ErrTampered) {
		t.Errorf("Open of clear bytes: error %v; want ErrTampered", err)
	}
}

func TestConcurrent(t *testing.T) {
	r := ring12(t)
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			ad := []byte{byte(g)}
			plain := bytes.Repeat([]byte{byte(g)}, 300)
			for range 200 {
				sealed, err := r.Seal(nil, plain, ad)
				if err != nil {
					t.Errorf("goroutine %d: Seal: %v", g, err)
					return
				}
				got, err := r.Open(nil, sealed, ad)
				if err != nil || !bytes.Equal(got, plain) {
					t.Errorf("goroutine %d: round trip = %d bytes, %v", g, len(got), err)
					return
				}
			}
		})
	}
	wg.Wait()
}

// FuzzOpen: Open never panics, and opens nothing but the values Seal made,
// under their own associated data.
func FuzzOpen(f *testing.F) {
	r := ring12(f)
	type orig struct{ sealed, ad, plain []byte }
	var origs []orig
	for i, p := range []string{"", "x", `{"card":"4111 1111 1111 1111"}`} {
		ad := []byte{'a', byte(i)}
		// A fixed nonce: each fuzz worker runs this again and must make
		// the very seeds the coordinator recorded.
		nonce := bytes.Repeat([]byte{byte(i)}, nonceSize)
		o := orig{r.seal(nil, []byte(p), ad, nonce), ad, []byte(p)}
		origs = append(origs, o)
		f.Add(o.sealed, o.ad)
	}
	f.Add([]byte{0xFF, 'S', 'L', 1, 2, 'k', '1'}, []byte(nil))
	f.Add([]byte{0x00, 0x00}, []byte("a"))
	f.Fuzz(func(t *testing.T, sealed, ad []byte) {
		got, err := r.Open(nil, sealed, ad)
		if err != nil {
			if !errors.Is(err, ErrTampered) && !errors.Is(err, ErrUnknownKey) {
				t.Fatalf("Open: error %v; want ErrTampered or ErrUnknownKey", err)
			}
			return
		}
		for _, o := range origs {
			if bytes.Equal(sealed, o.sealed) && bytes.Equal(ad, o.ad) {
				if !bytes.Equal(got, o.plain) {
					t.Fatalf("Open of an original = %q; want %q", got, o.plain)
				}
				return
			}
		}
		t.Fatalf("Open of a value Seal never made (%x, ad %x) = %q, nil; want an error", sealed, ad, got)
	})
}
