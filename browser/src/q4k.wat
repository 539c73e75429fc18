;; Q4_K x Q8_K rows in WebAssembly SIMD: the same integer dot and the same float64 order as
;; dotQ4K in kernel.js (so both give identical bits). Memory is laid out by kernel.js.
(module
  (memory (export "memory") 2)
  ;; scale | min << 8 of sub-block k from the 12 scale bytes at s (ggml's get_scale_min_k4)
  (func $sm (param $s i32) (param $k i32) (result i32)
    (if (result i32) (i32.lt_u (local.get $k) (i32.const 4))
      (then
        (i32.or
          (i32.and (i32.load8_u (i32.add (local.get $s) (local.get $k))) (i32.const 63))
          (i32.shl (i32.and (i32.load8_u (i32.add (local.get $s) (i32.add (local.get $k) (i32.const 4)))) (i32.const 63))
                   (i32.const 8))))
      (else
        (i32.or
          (i32.or (i32.and (i32.load8_u (i32.add (local.get $s) (i32.add (local.get $k) (i32.const 4)))) (i32.const 15))
                  (i32.shl (i32.shr_u (i32.load8_u (i32.add (local.get $s) (i32.sub (local.get $k) (i32.const 4)))) (i32.const 6))
                           (i32.const 4)))
          (i32.shl
            (i32.or (i32.shr_u (i32.load8_u (i32.add (local.get $s) (i32.add (local.get $k) (i32.const 4)))) (i32.const 4))
                    (i32.shl (i32.shr_u (i32.load8_u (i32.add (local.get $s) (local.get $k))) (i32.const 6)) (i32.const 4)))
            (i32.const 8))))))
  (func $dot8 (param $a v128) (param $b v128) (result v128)
    (i32x4.add
      (i32x4.extadd_pairwise_i16x8_s (i16x8.extmul_low_i8x16_s (local.get $a) (local.get $b)))
      (i32x4.extadd_pairwise_i16x8_s (i16x8.extmul_high_i8x16_s (local.get $a) (local.get $b)))))
  ;; out[r] = sum over blocks of W row r (rows x nb blocks of 144 bytes at w) . activation
  ;; (q: nb*256 int8, bs: nb*16 int32 block sums, d: nb float64 scales); tab: f16 -> f32 table.
  (func (export "q4k") (param $w i32) (param $rows i32) (param $nb i32) (param $q i32) (param $bs i32)
        (param $d i32) (param $tab i32) (param $out i32)
    (local $r i32) (local $b i32) (local $j i32) (local $p i32) (local $qs i32) (local $y i32)
    (local $sum f64) (local $dw f64) (local $mw f64) (local $acc v128) (local $msum i32)
    (local $sm1 i32) (local $sm2 i32) (local $v0 v128) (local $v1 v128) (local $mask v128) (local $o i32)
    (local.set $mask (i8x16.splat (i32.const 15)))
    (local.set $p (local.get $w))
    (block $rdone (loop $rloop
      (br_if $rdone (i32.ge_u (local.get $r) (local.get $rows)))
      (local.set $sum (f64.const 0))
      (local.set $b (i32.const 0))
      (block $bdone (loop $bloop
        (br_if $bdone (i32.ge_u (local.get $b) (local.get $nb)))
        (local.set $dw (f64.promote_f32 (f32.load (i32.add (local.get $tab) (i32.shl (i32.load16_u (local.get $p)) (i32.const 2))))))
        (local.set $mw (f64.promote_f32 (f32.load (i32.add (local.get $tab) (i32.shl (i32.load16_u offset=2 (local.get $p)) (i32.const 2))))))
        (local.set $acc (v128.const i32x4 0 0 0 0))
        (local.set $msum (i32.const 0))
        (local.set $j (i32.const 0))
        (block $jdone (loop $jloop
          (br_if $jdone (i32.ge_u (local.get $j) (i32.const 4)))
          (local.set $sm1 (call $sm (i32.add (local.get $p) (i32.const 4)) (i32.shl (local.get $j) (i32.const 1))))
          (local.set $sm2 (call $sm (i32.add (local.get $p) (i32.const 4)) (i32.add (i32.shl (local.get $j) (i32.const 1)) (i32.const 1))))
          (local.set $qs (i32.add (local.get $p) (i32.add (i32.const 16) (i32.shl (local.get $j) (i32.const 5)))))
          (local.set $y (i32.add (local.get $q) (i32.add (i32.shl (local.get $b) (i32.const 8)) (i32.shl (local.get $j) (i32.const 6)))))
          (local.set $v0 (v128.load (local.get $qs)))
          (local.set $v1 (v128.load offset=16 (local.get $qs)))
          (local.set $acc (i32x4.add (local.get $acc)
            (i32x4.mul (i32x4.splat (i32.and (local.get $sm1) (i32.const 255)))
              (i32x4.add (call $dot8 (v128.and (local.get $v0) (local.get $mask)) (v128.load (local.get $y)))
                         (call $dot8 (v128.and (local.get $v1) (local.get $mask)) (v128.load offset=16 (local.get $y)))))))
          (local.set $acc (i32x4.add (local.get $acc)
            (i32x4.mul (i32x4.splat (i32.and (local.get $sm2) (i32.const 255)))
              (i32x4.add (call $dot8 (i8x16.shr_u (local.get $v0) (i32.const 4)) (v128.load offset=32 (local.get $y)))
                         (call $dot8 (i8x16.shr_u (local.get $v1) (i32.const 4)) (v128.load offset=48 (local.get $y)))))))
          (local.set $o (i32.add (local.get $bs) (i32.shl (i32.add (i32.shl (local.get $b) (i32.const 4)) (i32.shl (local.get $j) (i32.const 2))) (i32.const 2))))
          (local.set $msum (i32.add (local.get $msum)
            (i32.add
              (i32.mul (i32.shr_u (local.get $sm1) (i32.const 8)) (i32.add (i32.load (local.get $o)) (i32.load offset=4 (local.get $o))))
              (i32.mul (i32.shr_u (local.get $sm2) (i32.const 8)) (i32.add (i32.load offset=8 (local.get $o)) (i32.load offset=12 (local.get $o)))))))
          (local.set $j (i32.add (local.get $j) (i32.const 1)))
          (br $jloop)))
        (local.set $sum (f64.add (local.get $sum)
          (f64.mul (f64.load (i32.add (local.get $d) (i32.shl (local.get $b) (i32.const 3))))
            (f64.sub
              (f64.mul (local.get $dw) (f64.convert_i32_s
                (i32.add (i32.add (i32x4.extract_lane 0 (local.get $acc)) (i32x4.extract_lane 1 (local.get $acc)))
                         (i32.add (i32x4.extract_lane 2 (local.get $acc)) (i32x4.extract_lane 3 (local.get $acc))))))
              (f64.mul (local.get $mw) (f64.convert_i32_s (local.get $msum)))))))
        (local.set $p (i32.add (local.get $p) (i32.const 144)))
        (local.set $b (i32.add (local.get $b) (i32.const 1)))
        (br $bloop)))
      (f32.store (i32.add (local.get $out) (i32.shl (local.get $r) (i32.const 2))) (f32.demote_f64 (local.get $sum)))
      (local.set $r (i32.add (local.get $r) (i32.const 1)))
      (br $rloop)))))
